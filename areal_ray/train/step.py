"""One training batch on every worker: advantages, proximal policy, PPO updates.

Given the step's flattened sequences (each with its scalar advantage, or for GAE its
shaped outcome reward), every rank takes its share and:
  1. builds micro-batches under a token budget (packed by default), the same count on
     every rank, split into `algo.optim.ppo_minibatches` PPO minibatches;
  2. GAE only: the critic's values -> per-token advantages and returns;
     `algo.adv.norm=batch` then normalises advantages over the whole batch (all ranks);
  3. proximal logprobs pi_prox (the weights before this batch's first update): with
     one minibatch the loss forward runs on exactly those weights, so its detached
     logprobs *are* pi_prox and no extra pass is needed; with several, they are
     recomputed by a no-grad forward up front, or approximated log-linearly from the
     behaviour logprobs and the current ones (AReaL's `loglinear`, no extra pass);
  4. with `algo.loss.kl_coef > 0`, reference logprobs from the frozen initial model;
  5. per minibatch: decoupled PPO loss normalised by the minibatch's global token
     count, one optimizer step; then one critic step on the value loss.

Every forward on a sharded model is a collective, so a rank whose micro-batch slot is
empty runs a zero-weight forward instead: ranks always run the same sequence of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_ray.algo.advantages import moments, normalize
from areal_ray.algo.loss import decoupled_ppo_loss
from areal_ray.algo.proximal import loglinear_proximal_logprobs
from areal_ray.algo.value import value_loss
from areal_ray.train.batching import (
    all_reduce,
    uses_varlen,
    build_microbatches,
    empty_forward,
    forward_logprobs,
    rank_share,
    split_minibatches,
    to_device,
)
from areal_ray.train.critic import forward_values, write_gae_targets
from areal_ray.train.fsdp import model_device

POLICY_STATS = ("clip_frac", "behav_weight_mean", "capped_frac", "approx_kl", "kl_ref")


@dataclass
class Models:
    policy: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    ref: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_opt: torch.optim.Optimizer | None = None


def _each(model, mbs: list, pad_id: int, fn) -> None:
    """fn(mb) on every micro-batch, a zero forward on empty slots; no gradients."""
    with torch.no_grad():
        for mb in mbs:
            if mb is None:
                empty_forward(model, pad_id)
            else:
                fn(mb)


def normalize_advantages(mbs: list) -> None:
    """Batch-level (all ranks) mean/std normalisation of the masked advantages."""
    local = [0.0, 0.0, 0.0]
    for mb in (m for m in mbs if m is not None):
        local = [x + y for x, y in zip(local, moments(mb["advantages"], mb["loss_mask"]))]
    stats = all_reduce(local)
    for mb in (m for m in mbs if m is not None):
        mb["advantages"] = normalize(mb["advantages"], mb["loss_mask"], stats=stats)


def _proximal(mb: dict, logp: torch.Tensor, cfg, minibatch: int, version: int) -> torch.Tensor:
    if not cfg.algo.loss.decoupled:  # plain PPO: the clip is centred on the behaviour policy
        return mb["behavior_logprobs"]
    if "proximal_logprobs" in mb:
        return mb["proximal_logprobs"]
    if minibatch > 0 and cfg.algo.loss.prox_logp == "loglinear":
        return loglinear_proximal_logprobs(logp, mb["behavior_logprobs"], mb["versions"], version)
    return logp.detach()  # the first minibatch runs on exactly the proximal weights


def train_step(m: Models, seqs: list[dict], cfg, pad_id: int, version: int) -> dict:
    """One batch of `algo.optim.ppo_minibatches` optimizer steps at policy `version`."""
    algo, temp = cfg.algo, cfg.rollout.temperature
    chunk = cfg.train.logits_chunk_mb << 20
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    varlen = uses_varlen(m.policy.config)
    # Every model of the worker (policy, reference, critic) is on the policy's device.
    # The whole step's micro-batches go there at once: packed for flash-attention they
    # are a few vectors of T entries (sdpa's block mask is T x T: use flash on GPUs).
    dev = model_device(m.policy)
    minis = [[to_device(mb, dev) for mb in build_microbatches(part, algo.microbatch.max_tokens,
                                                              algo.microbatch.pack, pad_id, varlen)]
             for part in split_minibatches(rank_share(seqs, rank, world), algo.optim.ppo_minibatches)]
    flat = [mb for mbs in minis for mb in mbs]
    timings = {}

    t = time.perf_counter()
    if m.critic is not None:
        _each(m.critic, flat, pad_id,
              lambda mb: write_gae_targets(m.critic, mb, algo.adv.gamma, algo.adv.gae_lambda))
    if algo.adv.norm == "batch":
        normalize_advantages(flat)
    timings["values_s"] = time.perf_counter() - t

    timings["prox_s"] = 0.0
    if algo.loss.decoupled and len(minis) > 1 and algo.loss.prox_logp == "recompute":
        t = time.perf_counter()
        _each(m.policy, flat, pad_id,
              lambda mb: mb.__setitem__("proximal_logprobs", forward_logprobs(m.policy, mb, temp, chunk)))
        timings["prox_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if m.ref is not None:
        _each(m.ref, flat, pad_id,
              lambda mb: mb.__setitem__("ref_logprobs", forward_logprobs(m.ref, mb, temp, chunk)))
    timings["ref_s"] = time.perf_counter() - t

    t = time.perf_counter()
    sums: dict[str, float] = {"loss": 0.0, "n_tokens": 0.0, "behav_weight_max": 0.0}
    grad_norms = []
    for k, mbs in enumerate(minis):
        global_tokens = all_reduce([sum(int(mb["loss_mask"].sum()) for mb in mbs if mb is not None)])[0]
        m.opt.zero_grad(set_to_none=True)
        for mb in mbs:
            if mb is None:
                (empty_forward(m.policy, pad_id) * world).backward()
                continue
            logp = forward_logprobs(m.policy, mb, temp, chunk)
            loss, stats = decoupled_ppo_loss(
                logp, _proximal(mb, logp, cfg, k, version), mb["behavior_logprobs"],
                mb["advantages"], mb["loss_mask"], eps_clip=algo.loss.eps_clip,
                eps_clip_high=algo.loss.eps_clip_high, dual_clip=algo.loss.dual_clip,
                behav_imp_weight_cap=algo.loss.behav_imp_weight_cap, normalizer=global_tokens,
                level=algo.loss.importance_level, seq_ids=mb["seq_ids"],
                ref_logprobs=mb.get("ref_logprobs"), kl_coef=algo.loss.kl_coef,
                kl_estimator=algo.loss.kl_estimator)
            # FSDP averages gradients over ranks; the loss is already a global token mean.
            (loss * world).backward()
            w = float(stats["n_tokens"])
            sums["loss"] += loss.item() / len(minis)
            sums["n_tokens"] += w
            for key in POLICY_STATS:
                sums[key] = sums.get(key, 0.0) + float(stats[key]) * w
            sums["behav_weight_max"] = max(sums["behav_weight_max"], float(stats["behav_weight_max"]))
        grad_norms.append(_clip(m.policy, algo.optim.max_grad_norm))
        m.opt.step()
    lr = m.sched.get_last_lr()[0]
    m.sched.step()
    timings["policy_s"] = time.perf_counter() - t

    keys = ["loss", "n_tokens", *POLICY_STATS]
    reduced = dict(zip(keys, all_reduce([sums.get(k, 0.0) for k in keys])))
    out = {"loss": reduced["loss"], "lr": lr, "grad_norm": max(grad_norms),
           "n_microbatches": len(flat), **timings}
    out.update({k: reduced[k] / max(reduced["n_tokens"], 1.0) for k in POLICY_STATS})
    out["behav_weight_max"] = all_reduce([sums["behav_weight_max"]], dist.ReduceOp.MAX)[0]
    if m.critic is not None:
        t = time.perf_counter()
        out.update(critic_step(m, flat, algo, pad_id, world))
        out["critic_s"] = time.perf_counter() - t
    out["train_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
    return out


def critic_step(m: Models, flat: list, algo, pad_id: int, world: int) -> dict:
    """One optimizer step of the critic on the clipped value loss (global token mean)."""
    n_tok = all_reduce([sum(int(mb["loss_mask"].sum()) for mb in flat if mb is not None)])[0]
    m.critic_opt.zero_grad(set_to_none=True)
    total, clipped = 0.0, 0.0
    for mb in flat:
        if mb is None:
            (empty_forward(m.critic, pad_id) * world).backward()
            continue
        loss, stats = value_loss(forward_values(m.critic, mb), mb["old_values"], mb["returns"],
                                 mb["loss_mask"], value_clip=algo.critic.value_clip, normalizer=n_tok)
        (loss * world).backward()
        total += loss.item()
        clipped += float(stats["value_clip_frac"]) * float(mb["loss_mask"].sum())
    _clip(m.critic, algo.optim.max_grad_norm)
    m.critic_opt.step()
    total, clipped = all_reduce([total, clipped])
    return {"value_loss": total, "value_clip_frac": clipped / max(n_tok, 1.0)}


def _clip(model, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
