"""The LR schedule: warm-up, then constant, linear or cosine decay to 0."""

import pytest
import torch

from areal_ray.train.schedule import lr_factor, make_scheduler


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 2 / 3, 1 / 3]),
    ("cosine", [0.5, 1.0, 1.0, 0.75, 0.25]),
])
def test_factors_by_hand(schedule, expected):
    # 2 warm-up steps of a 5-step run; the decay reaches 0 at step 5, just past the end
    assert [lr_factor(s, 5, 2, schedule) for s in range(5)] == pytest.approx(expected)


def test_scheduler_state_resumes_the_same_curve():
    def run(steps, state=None):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make_scheduler(opt, 6, 1, "cosine")
        if state:
            sched.load_state_dict(state)
        lrs = []
        for _ in range(steps):
            lrs.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return lrs, sched.state_dict()

    full, _ = run(6)
    first, state = run(3)
    rest, _ = run(3, state)
    assert first + rest == pytest.approx(full)
