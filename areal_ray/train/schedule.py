"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

A plain `LambdaLR` so its state (the step count) goes into the resume checkpoint
and a resumed run continues the exact same curve.
"""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the base lr before optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def make_scheduler(opt: torch.optim.Optimizer, total_steps: int, warmup: int,
                   schedule: str) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, warmup, schedule))
