"""Advantage estimators for outcome rewards (one scalar reward per sample).

GRPO normalises each sample's reward within its prompt group: A = (r - mean) / std.
The advantage is then broadcast to every generated token of the sample. A group in
which every sample got the same reward carries no signal and gets A = 0.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-5,
                    std_normalize: bool = True) -> torch.Tensor:
    """Group-normalised advantages.

    rewards: [n_groups, group_size]. Returns a tensor of the same shape.
    The std is the unbiased one (as AReaL's default), and `std_normalize=False`
    gives Dr.GRPO's mean-only centring.
    """
    if rewards.dim() != 2:
        raise ValueError(f"grpo_advantages expects [n_groups, group_size], got {tuple(rewards.shape)}")
    r = rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if not std_normalize or r.shape[1] < 2:
        return centred
    std = r.std(dim=1, unbiased=True, keepdim=True)
    return centred / (std + eps)
