"""Training/inference mismatch corrections of the behaviour weight, on tensors.

The decoupled objective weights every token by w = pi_prox / pi_behav: the trainer's
recomputed probability over the engine's. Engines and trainers disagree even at equal
weights (kernels, bf16, later FP8 or MoE routing), and a few tokens with extreme w
can dominate a step. A correction (the table in algo/corrections.py) turns w into a
weight and a mask; masked tokens leave the loss but still count in its denominator,
as the behaviour cap's do, so a correction never changes the loss's scale.
Log-ratios are bounded to [-20, 20] before exp, as in verl, so a sequence product
cannot overflow.

`mode=off` is not in the table: the loss then applies w with the upper
`algo.loss.behav_imp_weight_cap`, exactly as without this module. Also here: the
engine/trainer mismatch metrics of a step (`mismatch_sums`).
"""

from __future__ import annotations

import torch

from areal_ray.algo.corrections import CORRECTIONS, OFF, bounds
from areal_ray.algo.gspo import sequence_sums

LOG_BOUND = 20.0  # exp(+-20): verl's safety bound on IS log-ratios
MISMATCH = ("mismatch_k1", "mismatch_k3", "mismatch_chi2")


def behaviour_correction(log_w: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor | None,
                         mode: str, is_threshold: float = 2.0, rs_threshold: float | None = None,
                         rs_threshold_lower: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(weight, keep, stats) for the behaviour log-ratio `log_w` = log pi_prox - log pi_behav.

    `weight`: detached, per token (a sequence's weight on each of its tokens), 0 off
    `mask`; `keep`: the tokens the loss keeps (within `mask`); stats: the fractions of
    masked tokens truncated (`correction_truncated_frac`) and masked out
    (`correction_masked_frac`). `seq_ids` is needed by the sequence and geometric levels.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown correction {mode!r}; one of {(OFF, *CORRECTIONS)}")
    m = CORRECTIONS[mode]
    mask = mask.bool()
    needs_seq = m.weight == "sequence" or m.mask in ("sequence", "geometric")
    if needs_seq and seq_ids is None:
        raise ValueError(f"correction {mode!r} works per sequence and needs seq_ids")
    log_w = torch.where(mask, log_w.detach().float(), 0.0)
    token = log_w.clamp(-LOG_BOUND, LOG_BOUND)
    seq_log = geo_log = None
    if needs_seq:
        total, count = sequence_sums(log_w, seq_ids, mask, "behaviour_correction")
        geo_log = (total / count.clamp(min=1.0)).clamp(-LOG_BOUND, LOG_BOUND)
        seq_log = total.clamp(-LOG_BOUND, LOG_BOUND)

    if m.weight is None:
        weight = torch.ones_like(log_w)
    else:
        weight = torch.exp(token if m.weight == "token" else seq_log)
    truncated = torch.zeros_like(mask)
    if m.truncate:
        truncated = mask & (weight > is_threshold)
        weight = weight.clamp(max=is_threshold)
    keep = mask
    if m.mask is not None:
        lower, upper = bounds(m, is_threshold, rs_threshold, rs_threshold_lower)
        ratio = torch.exp({"token": token, "sequence": seq_log, "geometric": geo_log}[m.mask])
        keep = mask & (ratio >= lower) & (ratio <= upper)
    weight = torch.where(mask, weight, 0.0)
    n = mask.float().sum().clamp(min=1.0)
    stats = {"correction_truncated_frac": (truncated & mask).float().sum() / n,
             "correction_masked_frac": (mask & ~keep).float().sum() / n}
    return weight, keep, stats


def mismatch_sums(behavior_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, float]:
    """Sums over the masked tokens of the engine/trainer mismatch terms, for a caller
    that adds them over micro-batches and ranks before dividing by the token count.

    With r = pi_trainer / pi_behav on the engine's own samples:
    `mismatch_k1` sums log pi_behav - log pi_trainer (its mean estimates
    KL(pi_behav || pi_trainer); exp of the mean is the perplexity ratio
    ppl_trainer / ppl_behav); `mismatch_k3` sums r - 1 - log r (the same KL,
    non-negative, low variance); `mismatch_chi2` sums r^2 - 1 (its mean estimates the
    chi-square divergence, the variance an IS weight adds)."""
    mask = mask.bool()
    with torch.no_grad():
        # float64 and expm1: where the engine matches the trainer (r ~ 1) r - 1 - log r
        # is ~(log r)^2 / 2, which float32's r - 1 rounds below zero (-2.5e-9 seen)
        log_r = torch.where(mask, trainer_logprobs.double() - behavior_logprobs.double(), 0.0)
        log_r = log_r.clamp(-LOG_BOUND, LOG_BOUND)
        on = mask.double()
        k3 = (torch.expm1(log_r) - log_r).clamp_min(0.0)
        sums = torch.stack([(-log_r * on).sum(), (k3 * on).sum(),
                            (torch.expm1(2.0 * log_r) * on).sum()])
        return dict(zip(MISMATCH, sums.tolist()))  # one device sync, not three
