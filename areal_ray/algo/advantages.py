"""Advantage estimators for outcome rewards (one scalar reward per sample).

All estimators take rewards of shape [n_groups, group_size] (the samples of one
prompt form a group) and return advantages of the same shape, which the trainer
broadcasts to every generated token of a sample:

* GRPO: group-normalised, A = (r - mean) / (std + eps);
* Dr.GRPO: group-centred only, A = r - mean (no std: no bias towards easy/hard groups);
* RLOO: leave-one-out baseline, A_i = r_i - mean_{j != i} r_j.

A group in which every sample got the same reward carries no signal: A = 0 for all
three. `shape_rewards` applies AReaL's reward transform (bias, scale, clip) and DAPO's
overlong penalty before any estimator; `informative_groups` is DAPO's dynamic filter.

`normalize` is the batch-level advantage normalisation applied after the estimator
(AReaL's `adv_norm`, used by its GRPO recipe and the paper): it fixes the scale of the
policy gradient across steps whatever the reward scale and the share of solved groups.
It works on any shape (per-sample [n_groups, group_size] or per-token with a mask).
"""

from __future__ import annotations

import torch

from areal_ray.config.choices import AdvEstimator

# gae is not one of them: the critic turns rewards into advantages (areal_ray/train/critic.py)
ESTIMATORS = tuple(e for e in AdvEstimator.values() if e != AdvEstimator.gae)


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-5,
                    std_normalize: bool = True) -> torch.Tensor:
    """Group-normalised advantages; the std is the unbiased one (AReaL's default).
    `std_normalize=False` gives Dr.GRPO's mean-only centring."""
    _check(rewards)
    r = rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if not std_normalize or r.shape[1] < 2:
        return centred
    std = r.std(dim=1, unbiased=True, keepdim=True)
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out: each sample's baseline is the mean of the *other* samples."""
    _check(rewards)
    r = rewards.float()
    n = r.shape[1]
    if n < 2:
        return torch.zeros_like(r)
    others_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return r - others_mean


def advantages(rewards: torch.Tensor, estimator: str = "grpo") -> torch.Tensor:
    if estimator == "grpo":
        return grpo_advantages(rewards)
    if estimator == "dr_grpo":
        return grpo_advantages(rewards, std_normalize=False)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"unknown advantage estimator {estimator!r}; one of {ESTIMATORS}")


def moments(adv: torch.Tensor, mask: torch.Tensor | None = None) -> list[float]:
    """[count, sum, sum of squares] of the entries in `mask` (all when None): the
    statistics a data-parallel trainer all-reduces to normalise over the whole batch."""
    a = adv.double()
    keep = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.bool()
    if keep.shape != a.shape:
        raise ValueError(f"normalize: mask {tuple(keep.shape)} != adv {tuple(a.shape)}")
    vals = a[keep]
    return [float(vals.numel()), float(vals.sum()), float((vals * vals).sum())]


def normalize(adv: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-5,
              stats: list[float] | None = None) -> torch.Tensor:
    """(adv - mean) / (std + eps) over the entries in `mask` (all when None), with the
    unbiased std; entries outside the mask are 0 (padding must add no gradient).
    `stats`: `moments` of the whole batch when `adv` is only part of it."""
    n, total, sq = stats if stats is not None else moments(adv, mask)
    keep = torch.ones_like(adv, dtype=torch.bool) if mask is None else mask.bool()
    if n == 0:
        return torch.zeros_like(adv, dtype=torch.float32)
    mean = total / n
    # One entry has no spread (the unbiased std would be NaN): centre only.
    std = max(sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return torch.where(keep, (adv.float() - mean) / (std ** 0.5 + eps), 0.0)


def shape_rewards(rewards: torch.Tensor, bias: float = 0.0, scale: float = 1.0,
                  clip: float | None = None, lengths: torch.Tensor | None = None,
                  max_len: int | None = None, overlong_tokens: int = 0,
                  overlong_factor: float = 1.0) -> torch.Tensor:
    """r' = clip((r + bias) * scale) plus DAPO's overlong penalty.

    The penalty ramps linearly from 0 at `max_len - overlong_tokens` generated tokens
    to -overlong_factor at `max_len`: long answers are discouraged before they are cut.
    """
    r = (rewards.float() + bias) * scale
    if clip is not None:
        r = r.clamp(-clip, clip)
    if overlong_tokens > 0:
        if lengths is None or max_len is None:
            raise ValueError("the overlong penalty needs lengths and max_len")
        excess = lengths.float() - (max_len - overlong_tokens)
        r = r + torch.clamp(-excess / overlong_tokens * overlong_factor, max=0.0)
    return r


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic filter: a bool per group, False where all rewards are equal."""
    _check(rewards)
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0


def _check(rewards: torch.Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"expected rewards of shape [n_groups, group_size], got {tuple(rewards.shape)}")
