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
  5. per minibatch: the policy loss (`algo.loss.name`, from the registry in
     algo/losses.py; decoupled PPO by default) normalised by the minibatch's global
     token count, minus `algo.loss.entropy_coef` times the mean token entropy, one
     optimizer step; then one critic step on the value loss.

The loss forward also returns each position's entropy, from the logits its chunked
head computes anyway (algo/logprobs.py), and the step records it with the
engine/trainer mismatch on the trained tokens: `entropy`, `mismatch_kl` (k1, the
mean of log pi_behav - log pi_trainer), `mismatch_k3`, `mismatch_chi2` and
`mismatch_ppl_ratio` (ppl_trainer / ppl_behav), where pi_trainer is pi_prox where it
was recomputed and else the loss forward's own logprobs (the first minibatch's are
pi_prox exactly).

Non-finite numbers never reach the optimizer. A sequence whose reward, advantage or
behaviour logprobs are not finite is left out before any of this (algo/finite.py);
an optimizer step whose loss (any micro-batch, any rank) or gradient norm is still not
finite, e.g. overflowed from finite inputs, is skipped: its gradients are dropped and
the weights and optimizer state stay bit-identical. The stats count both
(`nonfinite_samples`, `skipped_nonfinite`, `critic_skipped_nonfinite`), `nonfinite`
names each, and `nonfinite_streak` counts the batches in a row that skipped a step.

Every forward on a sharded model is a collective, so a rank whose micro-batch slot is
empty runs a zero-weight forward instead: ranks always run the same sequence of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_ray.algo.advantages import moments, normalize
from areal_ray.algo.finite import screen
from areal_ray.algo.is_correction import MISMATCH, mismatch_sums
from areal_ray.algo.losses import LossInputs, policy_loss
from areal_ray.algo.proximal import loglinear_proximal_logprobs
from areal_ray.algo.value import value_loss
from areal_ray.train.batching import (
    all_reduce,
    build_microbatches,
    dense_row_tokens,
    empty_forward,
    forward_logprobs,
    rank_share,
    split_minibatches,
    to_device,
    uses_varlen,
)
from areal_ray.train.critic import forward_values, write_gae_targets
from areal_ray.train.fsdp import model_device

POLICY_STATS = ("clip_frac", "behav_weight_mean", "capped_frac", "approx_kl", "kl_ref",
                "correction_masked_frac", "correction_truncated_frac")
# Measured by the step itself on every micro-batch's trained tokens, whatever the loss:
# the policy's token entropy and the engine/trainer mismatch (algo/is_correction.py).
MEASURED = ("entropy", *MISMATCH)
MAX_NOTES = 20  # lines naming non-finite values kept in a step's stats


@dataclass
class Models:
    policy: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    ref: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_opt: torch.optim.Optimizer | None = None
    nonfinite_streak: int = 0  # batches in a row that skipped an optimizer step


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


def entropy_mode(cfg) -> str:
    """How the loss forward computes the entropy: with its gradient when it enters the
    loss, else as a value."""
    return "grad" if cfg.algo.loss.entropy_coef > 0 else "value"


def measured_sums(mb: dict, logp: torch.Tensor, ent: torch.Tensor | None) -> dict[str, float]:
    """This micro-batch's sums of MEASURED over its trained tokens (`mask_tokens`: their
    count), for the step to add up over micro-batches and ranks."""
    mask = mb["loss_mask"].bool()
    trainer = mb["proximal_logprobs"] if "proximal_logprobs" in mb else logp.detach()
    out = mismatch_sums(mb["behavior_logprobs"], trainer, mask)
    with torch.no_grad():
        ent_sum = (torch.where(mask, ent.detach().float(), 0.0).sum() if ent is not None
                   else torch.tensor(math.nan, device=mask.device))
        out["mask_tokens"], out["entropy"] = torch.stack([mask.float().sum(), ent_sum]).tolist()
    return out


def measured_stats(sums: dict[str, float]) -> dict[str, float]:
    """The step's MEASURED means from summed `measured_sums`."""
    n = max(sums["mask_tokens"], 1.0)
    k1 = sums["mismatch_k1"] / n
    return {"entropy": sums["entropy"] / n, "mismatch_kl": k1,
            "mismatch_k3": sums["mismatch_k3"] / n, "mismatch_chi2": sums["mismatch_chi2"] / n,
            "mismatch_ppl_ratio": math.exp(min(k1, 50.0))}


def _proximal(mb: dict, logp: torch.Tensor, cfg, minibatch: int, version: int) -> torch.Tensor:
    if not cfg.algo.loss.decoupled:  # plain PPO: the clip is centred on the behaviour policy
        return mb["behavior_logprobs"]
    if "proximal_logprobs" in mb:
        return mb["proximal_logprobs"]
    if minibatch > 0 and cfg.algo.loss.prox_logp == "loglinear":
        return loglinear_proximal_logprobs(logp, mb["behavior_logprobs"], mb["versions"], version)
    return logp.detach()  # the first minibatch runs on exactly the proximal weights


def train_step(m: Models, seqs: list[dict], cfg, pad_id: int, version: int) -> dict:
    """One batch of `algo.optim.ppo_minibatches` optimizer steps at policy `version`,
    on the sequences whose inputs are finite; see the module's docstring."""
    seqs, refused = screen(seqs)
    notes = list(refused)
    out = _train(m, seqs, cfg, pad_id, version, notes) if seqs else _nothing_to_train(m, cfg)
    skipped = out["skipped_nonfinite"] + out.get("critic_skipped_nonfinite", 0)
    m.nonfinite_streak = m.nonfinite_streak + 1 if skipped else 0
    out.update(nonfinite_samples=len(refused), nonfinite_streak=m.nonfinite_streak)
    if notes:
        out["nonfinite"] = notes[:MAX_NOTES]
        _warn(notes, version, m.nonfinite_streak)
    return out


def _warn(notes: list[str], version: int, streak: int) -> None:
    more = f" (and {len(notes) - 5} more)" if len(notes) > 5 else ""
    run = f"; {streak} batches in a row skipped an optimizer step" if streak > 1 else ""
    rank = f"rank {dist.get_rank()} " if dist.is_initialized() else ""
    print(f"[areal-ray] {rank}version {version}: non-finite values kept out of training: "
          f"{'; '.join(notes[:5])}{more}{run}", flush=True)


def _nothing_to_train(m: Models, cfg) -> dict:
    """The stats of a batch whose every sequence was left out: no forward, no optimizer
    step (the same on every rank: each sees the whole batch); the LR schedule still
    advances with the version."""
    lr = m.sched.get_last_lr()[0]
    m.sched.step()
    nan = float("nan")
    out = {"loss": nan, "lr": lr, "grad_norm": nan, "n_microbatches": 0,
           **{k: nan for k in (*POLICY_STATS, "behav_weight_max")},
           **{k: nan for k in measured_stats({k: 0.0 for k in (*MEASURED, "mask_tokens")})},
           "skipped_nonfinite": cfg.algo.optim.ppo_minibatches,
           **{k: 0.0 for k in ("values_s", "prox_s", "ref_s", "policy_s", "train_s")}}
    if m.critic is not None:
        out.update(value_loss=nan, value_clip_frac=nan, critic_skipped_nonfinite=1)
    return out


def nonfinite_step(local: str | None, grad_norm: float, where: str) -> str | None:
    """Why an optimizer step must not be taken, decided alike on every rank: a
    non-finite loss on any rank (`local` names this rank's), else a non-finite
    gradient norm (clip_grad_norm_'s is already global). None: take it."""
    anywhere = all_reduce([0.0 if local is None else 1.0], dist.ReduceOp.MAX)[0] > 0
    if anywhere:
        return local or f"{where}: a non-finite loss on another rank"
    if not math.isfinite(grad_norm):
        return f"{where}: grad_norm {grad_norm}"
    return None


def _worst(norms: list[float]) -> float:
    """The largest gradient norm, or the non-finite one."""
    return max(norms, key=lambda g: g if math.isfinite(g) else math.inf)


def _train(m: Models, seqs: list[dict], cfg, pad_id: int, version: int, notes: list[str]) -> dict:
    """train_step on finite inputs; appends a line to `notes` per skipped step."""
    algo, temp = cfg.algo, cfg.rollout.temperature
    chunk = cfg.train.logits_chunk_mb << 20
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    varlen = uses_varlen(m.policy.config)
    # Every model of the worker (policy, reference, critic) is on the policy's device.
    # The whole step's micro-batches go there at once: packed for flash-attention they
    # are a few vectors of T entries (sdpa's block mask is T x T: use flash on GPUs).
    dev = model_device(m.policy)
    dense_row = dense_row_tokens(m.policy.config, dev)
    minis = [[to_device(mb, dev) for mb in build_microbatches(part, algo.microbatch.max_tokens,
                                                              algo.microbatch.pack, pad_id, varlen,
                                                              dense_row)]
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
    loss_fn = policy_loss(algo.loss.name)
    ent_mode, ent_coef = entropy_mode(cfg), algo.loss.entropy_coef
    sums: dict[str, float] = {"loss": 0.0, "n_tokens": 0.0, "behav_weight_max": 0.0,
                              **{k: 0.0 for k in (*MEASURED, "mask_tokens")}}
    grad_norms, skipped = [], 0
    for k, mbs in enumerate(minis):
        global_tokens = all_reduce([sum(int(mb["loss_mask"].sum()) for mb in mbs if mb is not None)])[0]
        m.opt.zero_grad(set_to_none=True)
        bad = None
        for j, mb in enumerate(mbs):
            if mb is None:
                (empty_forward(m.policy, pad_id) * world).backward()
                continue
            out = forward_logprobs(m.policy, mb, temp, chunk, ent_mode)
            logp, ent = out[..., 0], out[..., 1]
            loss, stats = loss_fn(LossInputs(
                logp, _proximal(mb, logp, cfg, k, version), mb["behavior_logprobs"],
                mb["advantages"], mb["loss_mask"], normalizer=global_tokens,
                seq_ids=mb["seq_ids"], ref_logprobs=mb.get("ref_logprobs"), batch=mb), algo.loss)
            if ent_coef > 0:  # the bonus: a higher entropy lowers the loss
                mask = mb["loss_mask"].bool()
                loss = loss - ent_coef * torch.where(mask, ent, 0.0).sum() / max(global_tokens, 1.0)
            for key, value in measured_sums(mb, logp, ent).items():
                sums[key] += value
            # FSDP averages gradients over ranks; the loss is already a global token mean.
            (loss * world).backward()
            value = loss.item()
            if bad is None and not math.isfinite(value):
                bad = f"minibatch {k} micro-batch {j}: loss {value}"
            w = float(stats["n_tokens"] if "n_tokens" in stats else mb["loss_mask"].sum())
            sums["loss"] += value / len(minis)
            sums["n_tokens"] += w
            for key in POLICY_STATS:  # a stat the loss does not report: NaN, "not measured"
                sums[key] = sums.get(key, 0.0) + float(stats.get(key, math.nan)) * w
            top = float(stats.get("behav_weight_max", math.nan))
            sums["behav_weight_max"] = math.nan if math.isnan(top) else max(sums["behav_weight_max"], top)
        grad_norms.append(_clip(m.policy, algo.optim.max_grad_norm))
        why = nonfinite_step(bad, grad_norms[-1], f"minibatch {k}")
        if why is None:
            m.opt.step()
        else:  # the weights and the optimizer's state stay as they were
            m.opt.zero_grad(set_to_none=True)
            notes.append(f"optimizer step skipped: {why}")
            skipped += 1
    lr = m.sched.get_last_lr()[0]
    m.sched.step()
    timings["policy_s"] = time.perf_counter() - t

    keys = ["loss", "n_tokens", *POLICY_STATS, *MEASURED, "mask_tokens"]
    reduced = dict(zip(keys, all_reduce([sums.get(k, 0.0) for k in keys])))
    out = {"loss": reduced["loss"], "lr": lr, "grad_norm": _worst(grad_norms),
           "n_microbatches": len(flat), "skipped_nonfinite": skipped, **timings}
    out.update({k: reduced[k] / max(reduced["n_tokens"], 1.0) for k in POLICY_STATS})
    out.update(measured_stats(reduced))
    out["behav_weight_max"] = all_reduce([sums["behav_weight_max"]], dist.ReduceOp.MAX)[0]
    if m.critic is not None:
        t = time.perf_counter()
        out.update(critic_step(m, flat, algo, pad_id, world, notes))
        out["critic_s"] = time.perf_counter() - t
    out["train_s"] = sum(v for k, v in out.items() if k.endswith("_s"))
    return out


def critic_step(m: Models, flat: list, algo, pad_id: int, world: int,
                notes: list[str] | None = None) -> dict:
    """One optimizer step of the critic on the clipped value loss (global token mean),
    skipped like the policy's where the loss or the gradient norm is not finite."""
    n_tok = all_reduce([sum(int(mb["loss_mask"].sum()) for mb in flat if mb is not None)])[0]
    m.critic_opt.zero_grad(set_to_none=True)
    total, clipped, bad = 0.0, 0.0, None
    for j, mb in enumerate(flat):
        if mb is None:
            (empty_forward(m.critic, pad_id) * world).backward()
            continue
        loss, stats = value_loss(forward_values(m.critic, mb), mb["old_values"], mb["returns"],
                                 mb["loss_mask"], value_clip=algo.critic.value_clip, normalizer=n_tok)
        (loss * world).backward()
        value = loss.item()
        if bad is None and not math.isfinite(value):
            bad = f"critic micro-batch {j}: value_loss {value}"
        total += value
        clipped += float(stats["value_clip_frac"]) * float(mb["loss_mask"].sum())
    why = nonfinite_step(bad, _clip(m.critic, algo.optim.max_grad_norm), "critic")
    if why is None:
        m.critic_opt.step()
    else:
        m.critic_opt.zero_grad(set_to_none=True)
        if notes is not None:
            notes.append(f"critic step skipped: {why}")
    total, clipped = all_reduce([total, clipped])
    return {"value_loss": total, "value_clip_frac": clipped / max(n_tok, 1.0),
            "critic_skipped_nonfinite": int(why is not None)}


def _clip(model, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
