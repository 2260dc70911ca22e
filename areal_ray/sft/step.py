"""One SFT optimizer step, and the held-out loss, on the RL trainer's micro-batches.

The loss is the mean negative log-likelihood of the completion tokens of the whole
batch (all ranks): each micro-batch adds its masked NLL sum over the batch's global
completion-token count, so the gradient is the same however the rows are packed or
split over ranks. Micro-batching, the forward and the gradient clip are the RL step's
(train/batching.py, train/step.py); so is the rule that a non-finite loss or gradient
norm skips the optimizer step, leaving the weights as they were.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from areal_ray.train.batching import (
    all_reduce,
    build_microbatches,
    dense_row_tokens,
    empty_forward,
    forward_logprobs,
    rank_share,
    to_device,
    uses_varlen,
)
from areal_ray.train.fsdp import model_device
from areal_ray.train.step import Models, clip_grad_norm, nonfinite_step


def completion_nll(logp: torch.Tensor, loss_mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Sum of -logp over the masked (completion) positions, over `normalizer` (the
    batch's completion-token count)."""
    return -torch.where(loss_mask.bool(), logp, 0.0).sum() / max(normalizer, 1.0)


def _microbatches(m: Models, seqs: list[dict], cfg, pad_id: int) -> list[dict | None]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dev = model_device(m.policy)
    mbs = build_microbatches(rank_share(seqs, rank, world), cfg.algo.microbatch.max_tokens,
                             cfg.algo.microbatch.pack, pad_id, uses_varlen(m.policy.config),
                             dense_row_tokens(m.policy.config, dev))
    return [to_device(mb, dev) for mb in mbs]


def _tokens(mbs: list[dict | None]) -> float:
    return all_reduce([sum(float(mb["loss_mask"].sum()) for mb in mbs if mb is not None)])[0]


def sft_step(m: Models, seqs: list[dict], cfg, pad_id: int) -> dict:
    """One optimizer step on `seqs` (every rank passes the whole batch)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    chunk = cfg.train.logits_chunk_mb << 20
    mbs = _microbatches(m, seqs, cfg, pad_id)
    n_tok = _tokens(mbs)
    m.opt.zero_grad(set_to_none=True)
    total, bad = 0.0, None
    for j, mb in enumerate(mbs):
        if mb is None:  # FSDP's collectives need the same forwards on every rank
            (empty_forward(m.policy, pad_id) * world).backward()
            continue
        loss = completion_nll(forward_logprobs(m.policy, mb, 1.0, chunk), mb["loss_mask"], n_tok)
        (loss * world).backward()  # FSDP averages gradients over ranks
        value = loss.item()
        if bad is None and not math.isfinite(value):
            bad = f"micro-batch {j}: loss {value}"
        total += value
    grad_norm = clip_grad_norm(m.policy, cfg.algo.optim.max_grad_norm)
    why = nonfinite_step(bad, grad_norm, "sft")
    if why is None:
        m.opt.step()
    else:
        m.opt.zero_grad(set_to_none=True)
    lr = m.sched.get_last_lr()[0]
    m.sched.step()
    out = {"loss": all_reduce([total])[0], "grad_norm": grad_norm, "lr": lr,
           "n_tokens": n_tok, "n_microbatches": len(mbs), "skipped_nonfinite": int(why is not None)}
    if why is not None:
        out["nonfinite"] = why
    return out


@torch.no_grad()
def eval_loss(m: Models, seqs: list[dict], cfg, pad_id: int) -> float:
    """The mean completion NLL of `seqs` (every rank passes all of them)."""
    chunk = cfg.train.logits_chunk_mb << 20
    mbs = _microbatches(m, seqs, cfg, pad_id)
    n_tok = _tokens(mbs)
    total = 0.0
    for mb in mbs:
        if mb is None:
            empty_forward(m.policy, pad_id)
            continue
        total += completion_nll(forward_logprobs(m.policy, mb, 1.0, chunk), mb["loss_mask"], n_tok).item()
    return all_reduce([total])[0]
