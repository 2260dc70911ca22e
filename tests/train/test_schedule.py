"""The LR schedule: warm-up from 0, then constant, linear or cosine decay to 0, as the
optimizer sees it step by step."""

import pytest
import torch

from areal_ray.train.schedule import make_scheduler


def lrs(schedule: str, total: int, warmup: int, base: float = 2.0, state=None,
        steps: int | None = None) -> tuple[list[float], dict]:
    """The lr of each optimizer step (and the scheduler's state after them). A resumed
    optimizer gets its lr back with its own state (train/checkpoint.py); here the
    scheduler's restored last lr stands for it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make_scheduler(opt, total, warmup, schedule)
    if state:
        sched.load_state_dict(state)
    out = []
    for _ in range(total if steps is None else steps):
        out.append(sched.get_last_lr()[0])
        if not state:
            assert opt.param_groups[0]["lr"] == out[-1]  # what the optimizer steps with
        opt.step()
        sched.step()
    return out, sched.state_dict()


@pytest.mark.parametrize("schedule,factors", [
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 2 / 3, 1 / 3]),
    ("cosine", [0.0, 0.5, 1.0, 0.75, 0.25]),
])
def test_warm_up_then_decay_by_hand(schedule, factors):
    # 2 warm-up steps of a 5-step run: the lr rises from 0, and the decay reaches 0
    # at step 5, just past the end
    got, _ = lrs(schedule, total=5, warmup=2)
    assert got == pytest.approx([2.0 * f for f in factors])


@pytest.mark.parametrize("schedule,factors", [
    ("constant", [1.0, 1.0, 1.0, 1.0]),
    ("linear", [1.0, 0.75, 0.5, 0.25]),
    ("cosine", [1.0, 0.5 + 0.5 ** 0.5 / 2, 0.5, 0.5 - 0.5 ** 0.5 / 2]),
])
def test_without_warm_up_the_first_step_has_the_full_lr(schedule, factors):
    got, _ = lrs(schedule, total=4, warmup=0)
    assert got == pytest.approx([2.0 * f for f in factors])


def test_scheduler_state_resumes_the_same_curve():
    full, _ = lrs("cosine", total=6, warmup=1)
    first, state = lrs("cosine", total=6, warmup=1, steps=3)
    rest, _ = lrs("cosine", total=6, warmup=1, steps=3, state=state)
    assert first + rest == pytest.approx(full)
    assert len(set(full)) == 6  # a curve, not a constant that would resume trivially


def test_an_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        lrs("step", total=3, warmup=0)
