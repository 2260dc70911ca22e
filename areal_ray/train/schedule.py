"""Learning-rate schedule: linear warm-up from 0, then constant, linear or cosine
decay to 0 at `train.steps` (`algo.lr_schedule`, `algo.lr_warmup_steps`).

transformers' `get_scheduler` builds it: a `LambdaLR`, so its state (the step count)
goes into the resume checkpoint and a resumed run continues the exact same curve.
Its warm-up factor before optimizer step s is s / warmup: the first step of a run
with warm-up has lr 0 (it still fills AdamW's moments).
"""

from __future__ import annotations

import torch
from transformers import get_scheduler

# our schedule name -> transformers' (its "constant" would ignore the warm-up)
HF_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def make_scheduler(opt: torch.optim.Optimizer, total_steps: int, warmup: int,
                   schedule: str) -> torch.optim.lr_scheduler.LambdaLR:
    if schedule not in HF_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}: one of {sorted(HF_SCHEDULES)}")
    return get_scheduler(HF_SCHEDULES[schedule], opt, num_warmup_steps=warmup,
                         num_training_steps=total_steps)
