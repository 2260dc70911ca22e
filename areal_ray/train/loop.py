"""The Ray Train worker loop: one decoupled-PPO step per policy version.

Start (every rank): build the policy on the worker's device (its GPU with
`train.use_gpu`), then from the latest checkpoint's sharded state when Ray Train hands one back
(a restart after a failure, or a resumed run), its optimizer and LR schedule, the
frozen reference model (algo.loss.kl_coef > 0) and the critic (GAE); restore their states.
Rank 0 then gives the driver this run's starting point (version, next ticket,
rejected count, consumed prompts, and the weights when the replicas serve others),
which re-opens the staleness gate for the fresh pipeline.

Per step t, on every worker:
  1. the next B accepted groups in ticket order (StepAssembler; the dynamic filter
     drops all-equal groups and the gate admits replacements), which rank 0 records
     (train/batch_record.py); a replay (`run.replay`) reads the recorded ones instead;
  2. shaped rewards -> advantages per group (GRPO, Dr.GRPO, RLOO) or outcome rewards
     for GAE; per-sample staleness t - min(versions);
  3. train_step (train/step.py): micro-batches, proximal logprobs, PPO update(s);
  4. push version t+1 to every rollout replica (weights/push.py: a collective group,
     the object store, shm or disk, per `weights.path`; with `model.lora` only the
     adapter), then rank 0 records the step;
  5. every `train.checkpoint_every` steps, a resume checkpoint (train/checkpoint.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from areal_ray.algo.advantages import advantages, informative_groups, shape_rewards
from areal_ray.algo.finite import name, nonfinite
from areal_ray.cluster.ownership import tag_of_driver
from areal_ray.config import AlgoConfig, Config
from areal_ray.distill import advantage as distill
from areal_ray.driver.release import unreleased
from areal_ray.reward.pool import reason_kind
from areal_ray.rollout.workflows.base import EpisodeConfig
from areal_ray.train.batch_record import BatchRecorder, RecordedBatches
from areal_ray.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
    trainer_state,
)
from areal_ray.train.critic import load_critic
from areal_ray.train.feeder import ShardFeeder, StepAssembler
from areal_ray.train.fsdp import load_sharded_model
from areal_ray.train.lora import adapter_meta, trainable_parameters
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models, train_step
from areal_ray.types import Group
from areal_ray.weights.probe import probe_enabled
from areal_ray.weights.push import WeightPusher


def flatten_groups(groups: list[Group], algo: AlgoConfig, max_new_tokens: int,
                   trained_version: int) -> list[dict]:
    """One dict per non-empty sample, with its advantage and staleness. For GAE the
    "advantage" is the shaped outcome reward; the critic turns it into per-token ones.
    A sample whose reward, advantage or behaviour logprobs are not finite is named
    here, with the step; train_step leaves it out and reports it (algo/finite.py).
    A group estimator's advantages depend on every reward of the group: one NaN
    reward leaves the whole group out."""
    rewards = torch.tensor([[s.reward or 0.0 for s in g.samples] for g in groups])
    # The overlong penalty weighs the policy's own tokens: a tool's output is not verbosity.
    lengths = torch.tensor([[policy_tokens(s) for s in g.samples] for g in groups])
    rs = algo.reward_shaping
    shaped = shape_rewards(rewards, rs.bias, rs.scale, rs.clip,
                           lengths, max_new_tokens, rs.overlong_tokens, rs.overlong_factor)
    adv = shaped if algo.adv.estimator == "gae" else advantages(shaped, algo.adv.estimator)
    seqs = []
    for gi, g in enumerate(groups):
        for si, s in enumerate(g.samples):
            if not s.output_ids:
                continue
            seq = {"prompt_ids": s.prompt_ids, "output_ids": s.output_ids,
                   "logprobs": s.logprobs, "versions": s.versions,
                   "loss_mask": s.loss_mask, "advantage": float(adv[gi, si]), "reward": s.reward or 0.0,
                   "staleness": s.staleness(trained_version), "ticket": g.ticket, "sample": si}
            why = nonfinite(seq)
            if why is not None:
                print(f"[areal-ray] step {trained_version}: {name(seq, len(seqs))} is left out "
                      f"of training: {why}", flush=True)
            seqs.append(seq)
    if algo.distill.enabled:  # per-token advantages of the teacher-scored groups
        distill.apply(groups, seqs, algo.distill.coef, algo.distill.reward_weight)
    return seqs


def policy_tokens(s) -> int:
    return len(s.output_ids) if s.loss_mask is None else sum(s.loss_mask)


def has_samples(g: Group) -> bool:
    """A group without samples is a row the rollout workflow rejected: it held a
    ticket, and is dropped like a filtered group (data/pipeline.py)."""
    return bool(g.samples)


def informative(g: Group) -> bool:
    """DAPO's dynamic filter: a group whose rewards all agree carries no signal."""
    return has_samples(g) and bool(
        informative_groups(torch.tensor([[s.reward or 0.0 for s in g.samples]]))[0])


def release_replicas(driver, cfg: Config) -> dict:
    """With `rollout.release_memory`: the replicas free their engines' GPU memory before
    this step (the driver's release round); {} otherwise."""
    if not cfg.rollout.release_memory:
        return {}
    got = ray.get(driver.release_replicas.remote(cfg.run.push_timeout_s))
    error = unreleased(got["release_pending"], cfg.run.push_timeout_s)
    if error is not None:  # a replica still holds its memory: the step would OOM beside it
        raise error
    return {"release_s": got["release_s"], "release_pending": 0}


def must_publish(driver, cfg: Config, start: int) -> bool:
    """Whether this trainer start publishes its weights: when the replicas serve another
    version (a rollback, or fresh replicas of a resumed run), and when a trainer failed
    inside a release round, since the replicas get their memory back only at a
    publication (release.py)."""
    if ray.get(driver.version.remote()) != start:
        return True
    return cfg.rollout.release_memory and ray.get(driver.release_open.remote())


def give_back_memory() -> None:
    """Return the step's cached blocks to the device: PyTorch's caching allocator keeps
    them, and a rollout engine on the same GPU cannot use them otherwise."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker_device(use_gpu: bool) -> torch.device:
    """This worker's GPU (Ray Train gives each worker one and makes it the current
    device), or the CPU."""
    return ray.train.torch.get_device() if use_gpu else torch.device("cpu")


def build_models(cfg: Config, model_path: str, policy_path: str) -> Models:
    attn, master = cfg.model.attn_implementation, cfg.train.master_dtype
    dev = worker_device(cfg.train.use_gpu)
    policy = load_sharded_model(policy_path, cfg.model.dtype, attn_implementation=attn, device=dev,
                                master_dtype=master,
                                activation_checkpointing=cfg.train.activation_checkpointing,
                                lora=cfg.model.lora)
    optim = cfg.algo.optim
    # With LoRA only the adapter trains: the optimizer holds state for nothing else.
    opt = torch.optim.AdamW(trainable_parameters(policy), lr=optim.lr, weight_decay=optim.weight_decay,
                            betas=(0.9, 0.95), eps=1e-8)
    m = Models(policy, opt, make_scheduler(opt, cfg.train.steps, optim.lr_warmup_steps,
                                           optim.lr_schedule))
    if cfg.algo.loss.kl_coef > 0:  # the reference is the initial model, also after a resume
        m.ref = load_sharded_model(model_path, cfg.model.dtype, trainable=False,
                                   attn_implementation=attn, device=dev)
    if cfg.algo.adv.estimator == "gae":
        m.critic = load_critic(model_path, cfg.model.dtype, attn, device=dev, master_dtype=master)
        m.critic_opt = torch.optim.AdamW(m.critic.parameters(), lr=cfg.algo.critic.lr,
                                         betas=(0.9, 0.95), eps=1e-8)
    return m


def train_loop_per_worker(config: dict) -> None:
    cfg: Config = config["cfg"]
    torch.set_num_threads(cfg.train.torch_threads)
    torch.manual_seed(cfg.train.seed)
    rank = ray.train.get_context().get_world_rank()
    driver = ray.get_actor(config["driver_name"], namespace=config["namespace"])

    ckpt_dir = latest_checkpoint(config["checkpoint_root"], ray.train.get_checkpoint())
    batch_groups = cfg.algo.batch_groups
    state = read_trainer_state(ckpt_dir) if ckpt_dir else trainer_state(0, 0, batch_groups, [])
    m = build_models(cfg, config["model_path"], config["model_path"])
    if ckpt_dir:  # the weights and optimizer state, from the sharded state
        load_checkpoint(m, ckpt_dir)
    pad_id = m.policy.config.pad_token_id if m.policy.config.pad_token_id is not None else 0
    start = state["version"]
    consumed = list(state["consumed"])
    # LoRA: every publication is the adapter, with the base it must be applied to.
    adapter = adapter_meta(m.policy, cfg.model.lora, config["model_path"], cfg.model.dtype) \
        if cfg.model.lora.enabled else None
    pusher = WeightPusher(cfg.weights, driver, rank, config["weights_dir"],
                          owner=tag_of_driver(config["driver_name"]) or "", adapter=adapter,
                          probe=probe_enabled(cfg))

    try:  # its shm files go however the loop ends (an owner sweep: however the job does)
        # Replicas must serve exactly this run's version-`start` weights before any group
        # is admitted (a rollback after a failure, or a resumed run on fresh replicas).
        publish = must_publish(driver, cfg, start)
        if start == 0 and not ckpt_dir and not publish:  # both sides hold the model on disk
            pusher.baseline(m.policy)
        weights = pusher.gather(m.policy) if publish else None
        if rank == 0:
            ray.get(driver.restore.remote(start, state["next_ticket"], state["rejected"], consumed,
                                          pusher.object_payload(weights) if publish else None,
                                          records=state["records"]))
            print(f"[areal-ray] trainer starts at version {start}"
                  f"{' (from checkpoint ' + ckpt_dir.name + ')' if ckpt_dir else ''}", flush=True)

        if cfg.run.replay:  # the recorded run's steps, not the pipeline (batch_record.py)
            assembler = RecordedBatches(config["replay_dir"], m.policy.config.vocab_size)
        else:
            assembler = StepAssembler(
                ShardFeeder(ray.train.get_dataset_shard("train")), batch_groups,
                distributed=dist.is_initialized(),
                accept=informative if cfg.algo.dynamic_filter.enabled else has_samples,
                next_ticket=state["next_ticket"],
                on_reject=(lambda n: ray.get(driver.reject.remote(n))) if rank == 0 else None)
        recorder = BatchRecorder(config["batches_dir"], EpisodeConfig.from_config(cfg).seed) \
            if rank == 0 and cfg.run.record_batches and not cfg.run.replay else None
        t_start = t_prev = time.perf_counter()
        every = cfg.train.checkpoint_every
        unsaved: list[dict] = []  # step records since the last checkpoint (trainer_state)
        for step in range(start, cfg.train.steps):
            batch = assembler.next_step(step)
            if recorder is not None:
                recorder.write(step, batch)
            groups = batch.groups
            consumed += [g.pos for g in groups] + batch.rejected
            seqs = flatten_groups(groups, cfg.algo, cfg.rollout.max_new_tokens, trained_version=step)
            if not seqs:
                raise RuntimeError(f"step {step}: every sample is empty")
            release = release_replicas(driver, cfg) if rank == 0 else {}
            stats = train_step(m, seqs, cfg, pad_id, version=step)
            if cfg.rollout.release_memory:
                give_back_memory()  # the engine's resume at the push needs what the step cached
            weights, push = pusher.push(m.policy, step + 1)
            stop = False
            if rank == 0:
                now = time.perf_counter()
                stats.update(time_s=now - t_start, step_s=now - t_prev, t_wall=time.time(), **push,
                             **release)
                record = step_record(step, groups, seqs, batch, stats)
                if every:  # kept only for a checkpoint to come: a run without any keeps none
                    unsaved.append(record)
                stop = ray.get(driver.record_step.remote(record))
                t_prev = now
            if dist.is_initialized():  # every rank stops at the same step
                flag = [stop]
                dist.broadcast_object_list(flag, src=0)
                stop = flag[0]
            if every and ((step + 1) % every == 0 or stop):
                save_checkpoint(m, weights, trainer_state(step + 1, assembler.cursor, batch_groups,
                                                          consumed, unsaved),
                                config["model_path"], cfg.train.checkpoint_hf_model,
                                keep=cfg.run.keep_checkpoints, adapter=adapter)
                unsaved = []
            if dist.is_initialized():
                dist.barrier()
            if stop:
                if rank == 0:
                    print(f"[areal-ray] trainer stopped after version {step + 1}"
                          f"{' (checkpointed)' if every else ''}", flush=True)
                break
        if rank == 0:  # the driver keeps the final weights (late replicas, the final model)
            trained = start < cfg.train.steps
            final = pusher.object_payload(weights) \
                if trained and cfg.weights.path != "object_store" else None
            ray.get(driver.close.remote(final))
    finally:
        pusher.close()


def step_record(step: int, groups: list[Group], seqs: list[dict], batch, stats: dict) -> dict:
    stale = [s["staleness"] for s in seqs]
    samples = [s for g in groups for s in g.samples]
    # A non-finite reward was left out of the batch (algo/finite.py) and is counted in
    # `nonfinite_samples`; the mean is of the rewards that were trained on.
    rewards = [s.reward or 0.0 for s in samples if s.reward is None or math.isfinite(s.reward)]
    record = {
        "step": step, "version": step + 1,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "n_samples": len(samples), "n_tokens": sum(len(s.output_ids) for s in samples),
        "output_lens": [len(s.output_ids) for s in samples],
        "staleness_max": max(stale), "staleness_mean": sum(stale) / len(stale),
        "staleness_hist": {str(v): stale.count(v) for v in sorted(set(stale))},
        "tickets": [g.ticket for g in groups], "positions": [g.pos for g in groups],
        "informative_groups": sum(informative(g) for g in groups),
        "filtered_positions": batch.rejected,
        "abandoned_episodes": batch.abandoned,
        "admitted_versions": [g.admitted_version for g in groups],
        "resubmits": sum(s.n_resubmits for s in samples),
        # multi-turn workflows: how often the policy called a tool, and the tokens tools
        # wrote into trajectories (in the sequences, out of the loss)
        "tool_use_rate": sum(s.tool_calls > 0 for s in samples) / len(samples),
        "tool_calls": sum(s.tool_calls for s in samples),
        "tool_tokens": sum(s.loss_mask.count(0) for s in samples if s.loss_mask),
        "truncated_frac": sum(s.stop_reason == "length" for s in samples) / len(samples),
        "reward_reasons": dict(Counter(reason_kind(s.reward_reason) for s in samples)),
        "wait_s": batch.wait_s, **stats,
    }
    if any(distill.TEACHER in g.meta for g in groups) or batch.teacher_dropped:
        record.update(distill.metrics(groups, batch.teacher_dropped))
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
