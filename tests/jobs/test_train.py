"""End to end: the real job (Serve rollout, Ray Data pipeline, Ray Train FSDP2 trainer,
driver actor, MLflow) for a few steps of the tiny model, at several staleness bounds."""

import json

import mlflow
import pytest
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.run.job import run_training
from areal_ray.train.checkpoint import latest_checkpoint

STEPS, B = 5, 4
REQUIRED_STEP_KEYS = {"step", "version", "time_s", "reward_mean", "n_samples", "n_tokens",
                      "staleness_max", "staleness_mean"}
REQUIRED_SUMMARY_KEYS = {"steps", "eval_accuracy_before", "eval_accuracy_after", "wall_s",
                         "samples_per_s", "tokens_per_s", "max_staleness", "eta"}


def check_run(run_dir, mlflow_db, summary: dict, steps_n: int, eta: int, push_path: str,
              released: bool) -> list[dict]:
    """What every finished run of B x 4 samples per step leaves, at bound `eta`: the step
    records (tickets exactly once, in order; staleness within the bound; the push path;
    with `released`, the replica's memory given back before every step), summary.json,
    the final model and the MLflow run. The step records, for the caller's own checks."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(steps_n))
    assert [s["version"] for s in steps] == list(range(1, steps_n + 1))
    for s in steps:
        assert REQUIRED_STEP_KEYS <= s.keys()
        assert s["tickets"] == list(range(s["step"] * B, (s["step"] + 1) * B))  # exactly once, in order
        assert s["n_samples"] == B * 4
        assert 0 <= s["staleness_max"] <= eta  # every trained sample
        assert sum(s["staleness_hist"].values()) <= s["n_samples"]
        if eta == 0:  # synchronous: generated entirely by the version it trains
            assert s["staleness_max"] == 0 and s["admitted_versions"] == [s["step"]] * B
    assert {s["push_path"] for s in steps} == {push_path}
    assert all(s["replicas"] == 1 and s["push_bytes"] > 0 for s in steps)
    # every step's release round was answered by the replica before the step ran
    assert all((s.get("release_pending") == 0 and s["release_s"] >= 0) == released for s in steps)

    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert REQUIRED_SUMMARY_KEYS <= on_disk.keys()
    assert on_disk["steps"] == steps_n and on_disk["eta"] == eta
    assert on_disk["max_staleness"] <= eta
    assert 0.0 <= on_disk["eval_accuracy_after"] <= 1.0
    # where the time went (utilization.py): the trainer waits, the lengths are recorded
    assert 0.0 <= on_disk["trainer_idle_fraction"] <= 1.0
    assert on_disk["steady_samples_per_s"] > 0
    assert all(len(s["output_lens"]) == s["n_samples"] and sum(s["output_lens"]) == s["n_tokens"]
               for s in steps)
    assert on_disk["output_len_max"] == max(n for s in steps for n in s["output_lens"])
    assert (run_dir / "final_model" / "config.json").exists()

    mlflow.set_tracking_uri(f"sqlite:///{mlflow_db}")
    run = mlflow.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["algo.eta"] == str(eta)
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "reward_mean")
    assert len(history) == steps_n
    # the policy's entropy and the engine/trainer mismatch, measured by every step
    assert all(s["entropy"] > 0 and s["mismatch_k3"] >= 0 for s in steps)
    assert len(mlflow.MlflowClient().get_metric_history(run.info.run_id, "entropy")) == steps_n
    return steps


# The staleness bound at eta 4 on the coding task (conf/code.yaml: code rows, sandboxed
# checks), trained by two FSDP ranks over the gloo group's weight path. The other bounds
# are other jobs' checks: eta 0, as on one shared GPU with the replica freeing its
# engine's memory every step, is the first job of tests/jobs/test_resume.py (run twice,
# deterministic: the two are compared bit for bit); eta 1 and eta 2 the
# LoRA runs below (hf; vLLM, with every check of `check_run`), and the resumed dataset
# run of test_resume.py (eta 1, across two stops). The default weight path (auto: shared
# memory here) is the vLLM LoRA run's and test_resume's.
def test_async_rl_respects_the_staleness_bound(ray_cluster, embedded_model, tmp_path,
                                               available_sandbox):
    eta = 4
    cfg = load_config("conf/code.yaml", [
        "train.num_workers=2", f"reward.sandbox={available_sandbox}", "rollout.backend=hf",
        f"model.path={embedded_model}", f"algo.eta={eta}", f"algo.batch_groups={B}",
        f"train.steps={STEPS}", "rollout.group_size=4", "rollout.max_new_tokens=64",
        "task.n_eval=16", f"run.run_dir={tmp_path / 'run'}", f"run.name=e2e-eta{eta}",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        # two FSDP ranks also write a checkpoint: each rank's part lands in one dir
        f"train.checkpoint_every={STEPS}", "weights.path=collective"])
    summary = run_training(cfg)
    steps = check_run(tmp_path / "run", tmp_path / "mlflow.db", summary, STEPS, eta,
                      "collective", released=False)
    ckpt = latest_checkpoint(tmp_path / "run" / "train")
    assert {"rng_rank0.pt", "rng_rank1.pt", "state"} <= {p.name for p in ckpt.iterdir()}
    # each rank wrote its own shards; nothing was gathered on rank 0 but the HF export
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ckpt / "state").iterdir()}
    assert AutoModelForCausalLM.from_pretrained(ckpt / "model") is not None  # HF loads it
    assert summary["max_staleness"] >= 1  # the producer really ran ahead
    # the tiny arithmetic model writes no Python: 0 with a reason
    for s in steps:
        assert sum(s["reward_reasons"].values()) == s["n_samples"]
        assert set(s["reward_reasons"]) <= {"no fenced code block", "wrong answer", "all passed",
                                            "timeout", "exit", "killed", "output limit"}


@pytest.mark.parametrize("backend,atol,eta,n_steps,extra", [
    ("hf", 1e-4, 1, 3, ["weights.path=collective", "rollout.lora_push=pause", "run.eval_before=false"]),
    ("vllm", 1e-3, 2, STEPS, ["rollout.lora_push=finish"])])
def test_a_lora_run_pushes_only_the_adapter_and_every_replica_passes_the_probe(
        ray_cluster, embedded_model, tmp_path, backend, atol, eta, n_steps, extra):
    """conf/quickstart_lora.yaml through the real job on each engine that serves
    adapters: every push is the rank-4 adapter alone (hf: broadcast over the gloo
    group; vllm: shm, running requests finishing under the adapter they started with),
    staleness stays within eta, and each replica's load probe matches the trainer's
    (weights/probe.py). The vLLM run is also the staleness bound's vLLM case: every
    check of `check_run` at eta 2 over STEPS steps, evaluation before and after."""
    cfg = load_config("conf/quickstart_lora.yaml", [
        *extra, f"model.path={embedded_model}", f"rollout.backend={backend}", "model.lora.rank=4",
        "model.lora.alpha=8", f"algo.eta={eta}", f"algo.batch_groups={B}", f"train.steps={n_steps}",
        "rollout.group_size=4", "rollout.max_new_tokens=32",
        "task.n_eval=8", f"run.run_dir={tmp_path / 'run'}",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    summary = run_training(cfg)
    if backend == "vllm":
        check_run(tmp_path / "run", tmp_path / "mlflow.db", summary, n_steps, eta, "shm", released=False)
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == list(range(1, n_steps + 1))
    # 3 layers x (4 x 4 x (128 + 128) + 3 x 4 x (128 + 384)) float32 parameters
    adapter_bytes = 3 * (4 * 4 * 256 + 3 * 4 * 512) * 4
    assert all(s["push_bytes"] == adapter_bytes and s["staleness_max"] <= eta for s in steps)
    assert {s["push_path"] for s in steps} == {"collective" if backend == "hf" else "shm"}
    if backend == "vllm":  # finish: a push interrupts nothing, so nothing is resubmitted
        assert sum(s["resubmits"] for s in steps) == 0
    assert all(0 <= s["probe_max_diff"] <= atol for s in steps)
    # A step whose batch had no signal (every group's rewards equal: zero advantages,
    # grad_norm 0) leaves the adapter as it was, and its probe with it (probe_signal
    # 0.0): a skipped load could not be told from it. The others move the probe past
    # the tolerance.
    # (AdamW moves every adapter weight by about lr once its gradient is nonzero.)
    assert all(s["probe_signal"] > atol for s in steps[1:] if s["grad_norm"] > 0)
    assert (tmp_path / "run" / "final_model" / "adapter" / "adapter_config.json").exists()
