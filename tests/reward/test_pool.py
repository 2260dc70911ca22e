"""TimedChecker bounds every check; the RewardStage fills rewards with reasons."""

import os
import time

from areal_ray.reward.pool import RewardStage, TimedChecker
from areal_ray.types import Group, Sample


def slow_check(verifier, text, answer, opts=None):
    time.sleep(float(text))
    return 1.0


def crashing_check(verifier, text, answer, opts=None):
    os._exit(3)


def test_timeout_gives_zero_with_reason_and_the_checker_recovers():
    c = TimedChecker(timeout_s=0.5, fn=slow_check)
    t0 = time.perf_counter()
    assert c("math", "30", "1") == (0.0, "timeout after 0.5s")
    assert time.perf_counter() - t0 < 5
    # the replacement process starts inside this call: give it time to, however busy
    # the machine (a 0.5 s deadline here would race the spawn)
    assert c("math", "0", "1", timeout_s=60) == (1.0, "checked")
    c.close()


def test_crash_gives_zero_with_reason():
    c = TimedChecker(timeout_s=5, fn=crashing_check)
    reward, reason = c("math", "x", "1")
    assert reward == 0.0 and "died" in reason
    c.close()


def test_reward_stage_grades_each_sample():
    g = Group(ticket=3, uid="u", prompt="1+1=", answer="2", verifier="math", admitted_version=0,
              samples=[Sample([1], [2], [-0.1], [0], "stop", text=t)
                       for t in ("1+1=2.\\boxed{2}", "\\boxed{3}", "garbage")])
    row = g.to_row()
    stage = RewardStage(timeout_s=5)
    out = stage({"ticket": [row["ticket"]], "group": [row["group"]]})
    got = Group.from_row({"ticket": out["ticket"][0], "group": out["group"][0]})
    assert [s.reward for s in got.samples] == [1.0, 0.0, 0.0]
    assert all(s.reward_reason == "checked" for s in got.samples)
