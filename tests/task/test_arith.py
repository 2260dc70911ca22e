import random

from areal_ray.reward.math import math_reward
from areal_ray.task.arith import make_problem, make_split


def test_solutions_are_correct_and_verifiable():
    for p in make_split(seed=7, n=300):
        # each step of the worked solution is true arithmetic
        for part in p.solution.split(".\\boxed")[0].split(","):
            lhs, rhs = part.split("=")
            assert eval(lhs) == int(rhs)  # noqa: S307 - digits and +/- only
        assert eval(p.prompt.rstrip("=")) == int(p.answer)  # noqa: S307
        assert 0 <= int(p.answer) <= 99
        assert math_reward(p.solution, p.answer) == 1.0


def test_long_tail_of_lengths_and_determinism():
    probs = make_split(seed=1, n=2000, max_steps=8)
    steps = [p.n_steps for p in probs]
    assert steps.count(1) > steps.count(4) > steps.count(8) > 0
    assert make_split(seed=1, n=5) == make_split(seed=1, n=5)


def test_direct_solutions_show_no_work():
    p = make_problem(random.Random(0), p_direct=1.0)
    assert p.solution == "\\boxed{" + p.answer + "}"
