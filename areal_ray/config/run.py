"""`run.*`: the run as a whole: its name and outputs, the Ray cluster it joins, MLflow,
evals around training, resuming, and reproducibility (deterministic generation,
recorded batches, replay)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.section import opt, require

# What a resumed job may not change without `run.resume_allow_changes`, and why: a
# checkpoint's consumed prompt positions, weights and optimizer state only mean what
# they meant under these values. Keys left out (algo.eta, train.steps, workers,
# rollout and reward settings, eval) change how the run goes on, not what its
# checkpoint refers to.
_DATA = "decides which prompt a consumed stream position names"
_OPTIM = "restored from the checkpoint's optimizer and scheduler state: the new value would not take effect"
RESUME_GUARDED: dict[str, str] = {
    "train.seed": "seeds the trainer and the per-request sampling seeds",
    **{f"task.{k}": _DATA for k in ("train_path", "seed", "shuffle_window", "embedded",
                                    "prompt_template", "answer_field", "answer_pattern",
                                    "max_steps_per_problem", "chain_p_stop")},
    "model.path": "the checkpoint's weights and optimizer state are this model's",
    "model.dtype": "the checkpoint's weights and optimizer state are in this dtype",
    **{f"model.lora.{k}": "the checkpoint holds this adapter's weights and optimizer state"
       for k in ("enabled", "rank", "target_modules")},
    "model.lora.alpha": "the adapter's update is scaled by alpha / rank",
    "algo.batch_groups": "the checkpoint's ticket count is in steps of this many groups",
    "rollout.group_size": "what one trained group is (samples per prompt)",
    "algo.adv.estimator": "the checkpoint holds a critic only under gae",
    **{k: _OPTIM for k in ("algo.optim.lr", "algo.optim.weight_decay", "algo.critic.lr")},
    **{f"algo.optim.{k}": "the learning-rate curve the checkpoint is a point on"
       for k in ("lr_schedule", "lr_warmup_steps")},
}


@dataclass(kw_only=True)
class RunConfig:
    name: str = opt("quickstart", "run name (MLflow run name, run_dir default)")
    run_dir: str = opt("", "where steps.jsonl and summary.json go; empty: runs/<name>-<time>")
    shared_storage: bool | None = opt(None, "whether run.run_dir is storage every node mounts at the same path (Ray Train's workers store checkpoints there): null: decided by its filesystem's type (NFS, Lustre, GPFS, CephFS, s3fs, gcsfuse ...); true: it is (a shared filesystem the check does not know); false: it is not. On a cluster where the job and its trainer workers may be on more than one node, a run_dir that is not shared is refused (areal_ray/cluster/placement.py, check_run_dir)")
    ray_address: str = opt("", "Ray cluster to join; empty: the job's cluster or a new local one")
    num_cpus: int = opt(0, "logical CPUs of a local cluster this job starts; 0: Ray's default")
    task_events_kept: int = opt(10_000, "task events (records of task and actor calls) the GCS of a local cluster this job starts keeps for the dashboard and `ray list tasks` (Ray's task_events_max_num_task_in_gcs; Ray's default, 100000, is an estimated ~200 MiB of gcs_server a long run reaches); a `ray start` cluster takes this and the other bounds from RAY_* variables in the environment of `ray start --head` (docs/architecture.md, \"Long runs\")")
    inline_result_bytes: int = opt(1024, "largest task result a local cluster this job starts returns inline into its owner's memory (Ray's max_direct_call_object_size, 100 KiB by default): Ray Data's coordinator kept the bytes of every small block it owned, ~14 MiB per 100 quickstart steps; 1024 sends them through the object store and keeps a long run flat, at a measured ~8% of the quickstart's steady samples/s (102400: Ray's default, faster, growing; docs/architecture.md, \"Long runs\")")
    mlflow_tracking_uri: str = opt("", "MLflow tracking URI; empty: sqlite store under ./mlruns")
    mlflow_experiment: str = opt("areal-ray", "MLflow experiment name")
    log_model: bool = opt(True, "log the final model (HF format) as the MLflow run's `model` artifacts")
    register_model: str = opt("", "also register it in the MLflow model registry under this name; empty: don't")
    eval_before: bool = opt(True, "greedy eval on the held-out split before training")
    eval_after: bool = opt(True, "greedy eval on the held-out split after training")
    overlap_start: bool = opt(True, "start the trainer's workers and the data pipeline while the rollout replicas start and the eval before runs (no prompt is admitted until that eval is done); a GPU shared by a replica and a trainer worker always starts its engine first (areal_ray/run/startup.py)")
    check_placement: bool = opt(True, "before deploying, refuse a run whose replicas, trainer workers and reward actors cannot fit the cluster's nodes (and, with train.gpu_memory_gib, a GPU shared by an engine and a trainer that lacks memory for both); off for an autoscaling cluster that adds nodes on demand (the placement deadline still holds)")
    placement_timeout_s: float = opt(600.0, "deadline for the rollout replicas and the trainer workers to be placed on the cluster; past it the job fails naming what could not be placed (an autoscaling cluster may need longer to add nodes)")
    push_timeout_s: float = opt(120.0, "a replica that has not loaded a push by then is dropped; with rollout.release_memory, a release round still unanswered then fails the step (naming the replica), and a replica starting during a step waits up to this long for it to end")
    resume: bool = opt(False, "continue the run in run.run_dir from its newest complete checkpoint (a damaged one is skipped with a warning)")
    resume_allow_changes: list[str] = opt([], "keys a resume may change although they decide what the checkpoint refers to (data, model, optimizer; the list is RESUME_GUARDED in areal_ray/config/run.py), e.g. [train.seed]; a change not listed is refused, and each resumed job's config is kept as <run_dir>/config.resume-<n>.json")
    keep_checkpoints: int = opt(3, "complete checkpoints kept: older ones are deleted once a newer one is complete (the newest is always kept); 0: keep all")
    deterministic: bool = opt(False, "reproducible generation: per-request sampling seeds from train.seed, prompts admitted in stream order, the hf engine's batch-invariant layout; bit-identical runs at algo.eta=0 (docs/reproducibility.md)")
    record_batches: bool = opt(True, "write every step's groups (positions, seeds, token ids, logprobs, versions, rewards) to <run_dir>/batches/, which run.replay retrains")
    replay: str = opt("", "a recorded run's dir: retrain exactly its steps' batches, in order, without generation (docs/reproducibility.md)")

    def check(self) -> None:
        require(not (self.replay and self.resume), "run.replay and run.resume cannot be combined: a replay starts from the model")
        require(self.placement_timeout_s > 0, "run.placement_timeout_s must be > 0")
        require(not self.resume or bool(self.run_dir), "run.resume needs run.run_dir (the run to continue)")
        require("://" not in self.run_dir, f"run.run_dir={self.run_dir} is a URI: the run dir is read and written as files (steps, checkpoint markers, the final model); for storage every node shares, mount it (NFS, or a bucket through s3fs or gcsfuse) and pass the mount's path")
        require(self.log_model or not self.register_model, "run.register_model needs run.log_model=true")
        require(self.task_events_kept > 0, "run.task_events_kept must be > 0")
        require(self.inline_result_bytes >= 0, "run.inline_result_bytes must be >= 0")
        require(self.keep_checkpoints >= 0, "run.keep_checkpoints must be >= 0 (0: keep all)")
        unknown = [k for k in self.resume_allow_changes if k not in RESUME_GUARDED]
        require(not unknown, f"run.resume_allow_changes: {unknown} are not keys a resume refuses to "
                             f"change; those are {sorted(RESUME_GUARDED)}")
