"""Per-sequence means broadcast back to tokens, for sequence-level objectives (GSPO).

GSPO (Group Sequence Policy Optimization) argues that the reward is given to a whole
sequence, so the importance ratio should be one per sequence too: the geometric mean
of the token ratios, exp(mean_t log(pi_theta / pi_prox)), with the sequence's mean
advantage. One number per sequence keeps a few extreme token ratios from being
clipped on their own, and the length normalisation keeps long and short answers on
one scale.

The loss still works on token-shaped tensors (padded [B, L] or packed [T]), so each
token receives its sequence's mean. Sequences are identified by `seq_ids` (the
"seq_ids" micro-batch target), which works for both layouts; gradient flows through
the mean, so every token of a sequence gets the sequence's gradient share.
"""

from __future__ import annotations

import torch


def sequence_sums(x: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor,
                  what: str = "sequence_sums") -> tuple[torch.Tensor, torch.Tensor]:
    """Each masked token gets its sequence's sum of `x` and its count of masked tokens,
    over the masked tokens of that sequence; unmasked tokens get 0 and 0.
    Differentiable w.r.t. `x`. `what` names the caller in errors.

    `seq_ids`: same shape as `x`, the sequence index (>= 0) of every masked token;
    its values off the mask are ignored (the micro-batch targets hold -1 there).
    """
    if seq_ids.shape != x.shape or mask.shape != x.shape:
        raise ValueError(f"{what}: shapes differ: x {tuple(x.shape)}, "
                         f"seq_ids {tuple(seq_ids.shape)}, mask {tuple(mask.shape)}")
    mask = mask.bool()
    if not mask.any():
        return torch.zeros_like(x), torch.zeros_like(x)
    if bool((seq_ids[mask] < 0).any()):
        raise ValueError(f"{what}: a masked token has a negative seq_id")
    # Unmasked tokens are routed to sequence 0 with weight 0, so -1 never indexes.
    idx = torch.where(mask, seq_ids, 0).reshape(-1).long()
    vals = torch.where(mask, x, 0.0).reshape(-1)
    n_seq = int(idx.max()) + 1
    sums = torch.zeros(n_seq, dtype=vals.dtype, device=vals.device).index_add(0, idx, vals)
    counts = torch.zeros(n_seq, dtype=vals.dtype, device=vals.device).index_add(
        0, idx, mask.reshape(-1).to(vals.dtype))

    def back(v: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, v[idx].reshape(x.shape), 0.0)
    return back(sums), back(counts)


def sequence_mean(x: torch.Tensor, seq_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each masked token gets the mean of `x` over the masked tokens of its sequence;
    unmasked tokens get 0. Differentiable w.r.t. `x` (`sequence_sums`)."""
    sums, counts = sequence_sums(x, seq_ids, mask, "sequence_mean")
    return sums / counts.clamp(min=1.0)
