"""The Ray Train worker loop: one decoupled-PPO step per policy version.

Per step t, on every worker:
  1. take the groups with tickets [t*B, (t+1)*B) (StepAssembler), this rank's share;
  2. shaped rewards -> advantages per group (GRPO, Dr.GRPO or RLOO); per-sample
     staleness t - min(versions);
  3. proximal logprobs: the weights of version t (a separate no-grad forward only
     when a batch takes several optimizer steps, see train_step);
  4. micro-batches under a token budget (packed by default, same count on every
     rank; train/batching.py), decoupled PPO loss normalised by the step's global
     token count, one optimizer step;
  5. gather the full weights; rank 0 puts them in the object store and the driver
     pushes them to every rollout replica as version t+1, then records the step.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import ray
import ray.train
import torch
import torch.distributed as dist

from areal_ray.algo.advantages import advantages, shape_rewards
from areal_ray.algo.loss import decoupled_ppo_loss
from areal_ray.config import AlgoConfig, Config
from areal_ray.reward.pool import reason_kind
from areal_ray.train.batching import (all_reduce, build_microbatches, empty_forward,
                                     forward_logprobs, rank_share, split_minibatches)
from areal_ray.train.feeder import ShardFeeder, StepAssembler
from areal_ray.train.fsdp import full_state_dict, load_sharded_model
from areal_ray.types import Group


def flatten_groups(groups: list[Group], algo: AlgoConfig, max_new_tokens: int,
                   trained_version: int) -> list[dict]:
    """One dict per non-empty sample, with its advantage and staleness."""
    rewards = torch.tensor([[s.reward or 0.0 for s in g.samples] for g in groups])
    lengths = torch.tensor([[len(s.output_ids) for s in g.samples] for g in groups])
    shaped = shape_rewards(rewards, algo.reward_bias, algo.reward_scale, algo.reward_clip,
                           lengths, max_new_tokens, algo.overlong_tokens, algo.overlong_factor)
    adv = advantages(shaped, algo.adv_estimator)
    seqs = []
    for gi, g in enumerate(groups):
        for si, s in enumerate(g.samples):
            if not s.output_ids:
                continue
            seqs.append({"prompt_ids": s.prompt_ids, "output_ids": s.output_ids,
                         "logprobs": s.logprobs, "versions": s.versions,
                         "advantage": float(adv[gi, si]), "reward": s.reward or 0.0,
                         "staleness": s.staleness(trained_version), "ticket": g.ticket})
    return seqs


def train_step(model, opt, seqs: list[dict], cfg: Config, pad_id: int) -> dict:
    """One batch: `algo.ppo_minibatches` optimizer steps. Returns summed/averaged stats."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    minis = [build_microbatches(part, cfg.algo.max_tokens_per_mb, cfg.algo.pack, pad_id)
             for part in split_minibatches(rank_share(seqs, rank, world), cfg.algo.ppo_minibatches)]
    temp = cfg.rollout.temperature

    # pi_prox is the policy before this batch's first update. With one minibatch the
    # loss forward runs on exactly those weights, so its detached logprobs *are* the
    # proximal logprobs and a separate forward would only repeat it; with several,
    # later minibatches run on updated weights and pi_prox is recomputed up front.
    t0 = time.perf_counter()
    if cfg.algo.decoupled and len(minis) > 1:
        with torch.no_grad():
            for mb in (mb for mbs in minis for mb in mbs if mb is not None):
                mb["proximal_logprobs"] = forward_logprobs(model, mb, temp)
    prox_s = time.perf_counter() - t0

    sums: dict[str, float] = {}
    grad_norms = []
    for mbs in minis:
        n_tok = sum(int(mb["loss_mask"].sum()) for mb in mbs if mb is not None)
        global_tokens = all_reduce([n_tok])[0]
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            if mb is None:
                (empty_forward(model, pad_id) * world).backward()
                continue
            logp = forward_logprobs(model, mb, temp)
            if not cfg.algo.decoupled:  # plain PPO: the clip is centred on the behaviour policy
                prox = mb["behavior_logprobs"]
            else:
                prox = mb.get("proximal_logprobs", logp.detach())
            loss, stats = decoupled_ppo_loss(
                logp, prox, mb["behavior_logprobs"], mb["advantages"], mb["loss_mask"],
                eps_clip=cfg.algo.eps_clip, eps_clip_high=cfg.algo.eps_clip_high,
                dual_clip=cfg.algo.dual_clip, behav_imp_weight_cap=cfg.algo.behav_imp_weight_cap,
                normalizer=global_tokens)
            # FSDP averages gradients over ranks; the loss is already a global token mean.
            (loss * world).backward()
            w = float(stats["n_tokens"])
            sums["loss"] = sums.get("loss", 0.0) + loss.item() / len(minis)
            sums["n_tokens"] = sums.get("n_tokens", 0.0) + w
            for key in ("clip_frac", "behav_weight_mean", "capped_frac", "approx_kl"):
                sums[key] = sums.get(key, 0.0) + float(stats[key]) * w
            sums["behav_weight_max"] = max(sums.get("behav_weight_max", 0.0),
                                           float(stats["behav_weight_max"]))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.algo.max_grad_norm)
        grad_norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
    keys = ["loss", "n_tokens", "clip_frac", "behav_weight_mean", "capped_frac", "approx_kl"]
    reduced = dict(zip(keys, all_reduce([sums.get(k, 0.0) for k in keys])))
    out = {"loss": reduced["loss"]}
    out.update({k: reduced[k] / max(reduced["n_tokens"], 1.0) for k in keys[2:]})
    out["behav_weight_max"] = all_reduce([sums.get("behav_weight_max", 0.0)], dist.ReduceOp.MAX)[0]
    out.update({"grad_norm": max(grad_norms), "n_microbatches": sum(len(m) for m in minis),
                "prox_s": prox_s, "train_s": time.perf_counter() - t0})
    return out


def train_loop_per_worker(config: dict) -> None:
    cfg: Config = config["cfg"]
    torch.set_num_threads(cfg.train.torch_threads)
    torch.manual_seed(cfg.train.seed)
    rank = ray.train.get_context().get_world_rank()
    driver = ray.get_actor(config["driver_name"], namespace=config["namespace"])
    model = load_sharded_model(config["model_path"], cfg.model.dtype)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay,
                            betas=(0.9, 0.95), eps=1e-8)
    assembler = StepAssembler(ShardFeeder(ray.train.get_dataset_shard("train")),
                              cfg.algo.batch_groups, distributed=dist.is_initialized())
    t_start = time.perf_counter()
    for step in range(cfg.train.steps):
        groups, wait_s = assembler.next_step(step)
        seqs = flatten_groups(groups, cfg.algo, cfg.rollout.max_new_tokens, trained_version=step)
        if not seqs:
            raise RuntimeError(f"step {step}: every sample is empty")
        stats = train_step(model, opt, seqs, cfg, pad_id)
        t_gather = time.perf_counter()
        state = full_state_dict(model)
        gather_s = time.perf_counter() - t_gather
        if rank == 0:
            ref = ray.put(state)
            push = ray.get(driver.push_weights.remote(step + 1, [ref]))
            stale = [s["staleness"] for s in seqs]
            samples = [s for g in groups for s in g.samples]
            record = {
                "step": step, "version": step + 1, "time_s": time.perf_counter() - t_start,
                "reward_mean": sum(s.reward or 0.0 for s in samples) / len(samples),
                "n_samples": len(samples), "n_tokens": sum(len(s.output_ids) for s in samples),
                "staleness_max": max(stale), "staleness_mean": sum(stale) / len(stale),
                "staleness_hist": {str(v): stale.count(v) for v in sorted(set(stale))},
                "tickets": [g.ticket for g in groups],
                "admitted_versions": [g.admitted_version for g in groups],
                "resubmits": sum(s.n_resubmits for s in samples),
                "truncated_frac": sum(s.stop_reason == "length" for s in samples) / len(samples),
                "reward_reasons": dict(Counter(reason_kind(s.reward_reason) for s in samples)),
                "wait_s": wait_s, "gather_s": gather_s, "push_s": push["push_s"],
                "replicas": push["replicas"], **stats,
            }
            record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                      for k, v in record.items()}
            ray.get(driver.record_step.remote(record))
        if dist.is_initialized():
            dist.barrier()
    if rank == 0:
        ray.get(driver.close.remote())
