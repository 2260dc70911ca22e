"""TimedChecker bounds every check; the RewardStage fills rewards with reasons."""

import os
import pickle
import time

import pytest

from areal_ray.config import RewardConfig
from areal_ray.reward.pool import RewardStage, TimedChecker, graded, reason_kind
from areal_ray.types import Group, Sample


def slow_check(verifier, text, answer, opts=None):
    time.sleep(float(text))
    return 1.0


def crashing_check(verifier, text, answer, opts=None):
    os._exit(3)


ANSWERS = {"nan": float("nan"), "inf": float("inf"), "-inf": (float("-inf"), "scored"),
           "text": "1.0?", "none": None, "ok": (0.5, "scored")}


def answering_check(verifier, text, answer, opts=None):
    return ANSWERS[text]


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


def test_a_check_function_that_cannot_travel_is_refused_before_a_process_starts():
    c = TimedChecker(timeout_s=5, fn=lambda *a: 1.0)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        c("math", "1", "1")
    assert c._proc is None  # no child left waiting for a function that never comes


def test_reward_stage_grades_each_sample():
    g = Group(ticket=3, uid="u", prompt="1+1=", answer="2", verifier="math", admitted_version=0,
              samples=[Sample([1], [2], [-0.1], [0], "stop", text=t)
                       for t in ("1+1=2.\\boxed{2}", "\\boxed{3}", "garbage")])
    row = g.to_row()
    stage = RewardStage(RewardConfig(timeout_s=5))
    out = stage({"ticket": [row["ticket"]], "group": [row["group"]]})
    got = Group.from_row({"ticket": out["ticket"][0], "group": out["group"][0]})
    assert [s.reward for s in got.samples] == [1.0, 0.0, 0.0]
    assert all(s.reward_reason == "checked" for s in got.samples)


@pytest.fixture(scope="module")
def answering():
    c = TimedChecker(timeout_s=60, fn=answering_check)
    yield c
    c.close()


@pytest.mark.parametrize("answer, reason, kind", [
    ("nan", "non-finite reward nan from the 'math' checker (checked)", "non-finite"),
    ("inf", "non-finite reward inf from the 'math' checker (checked)", "non-finite"),
    ("-inf", "non-finite reward -inf from the 'math' checker (scored)", "non-finite"),
    ("text", "checker error: the 'math' checker's reward '1.0?' is not a number", "checker error"),
    ("none", "checker error: the 'math' checker's reward None is not a number", "checker error"),
], ids=["nan", "inf", "-inf", "text", "none"])
def test_a_reward_that_is_not_a_finite_number_is_zero_with_the_reason(answering, answer, reason,
                                                                      kind):
    """A NaN from a checker would make the group's advantages, the loss and then every
    weight NaN: it is 0, recorded as a checker exception is."""
    assert answering("math", answer, "1") == (0.0, reason)
    assert reason_kind(reason) == kind


def test_a_finite_reward_passes_unchanged(answering):
    assert answering("math", "ok", "1") == (0.5, "scored")
    assert graded(1, "math") == (1.0, "checked") and graded(True, "code") == (1.0, "checked")
