"""The teacher stage's deadline: an answer, a late call, a failed call and an answer
that does not fit each end with the group marked, and a late call never holds it."""

import asyncio
import time

import pytest

from areal_ray.distill.advantage import FAILED, LATE, OK, TEACHER
from areal_ray.distill.stage import TeacherScoring
from deployments.teacher import completion_logprobs
from tests.distill.test_advantage import group, sample


def score_each_token(value):
    async def score(pairs):
        return [[value] * len(o) for _, o in pairs]
    return score


def run(scoring, g):
    return asyncio.run(scoring(g))


def test_an_answer_in_time_is_kept_with_its_logprobs():
    g = run(TeacherScoring(score_each_token(-0.25), deadline_s=5.0),
            group(sample([-1.0, -1.0]), sample([-1.0])))
    v = g.meta[TEACHER]
    assert v["status"] == OK and v["logprobs"] == [[-0.25, -0.25], [-0.25]] and v["s"] < 5.0


def test_a_teacher_past_its_deadline_is_counted_and_does_not_hold_the_group():
    async def never(pairs):
        await asyncio.Event().wait()

    scoring = TeacherScoring(never, deadline_s=0.2)
    t0 = time.monotonic()
    g = run(scoring, group(sample([-1.0])))
    assert time.monotonic() - t0 < 2.0
    assert g.meta[TEACHER]["status"] == LATE and "deadline_s=0.2" in g.meta[TEACHER]["why"]
    assert g.samples and scoring.late == 1  # late=reward: trained on the task reward alone


def test_a_call_that_ignores_its_cancellation_is_left_behind():
    async def stubborn(pairs):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # unwinds slowly: the group must not wait for it
            raise

    async def main():
        scoring = TeacherScoring(stubborn, deadline_s=0.1, late="drop")
        t0 = time.monotonic()
        g = await scoring(group(sample([-1.0])))
        return g, time.monotonic() - t0, scoring
    g, took, scoring = asyncio.run(main())
    assert took < 0.45 and g.samples == [] and g.meta[TEACHER]["dropped"] and scoring.late == 1


def test_a_failed_call_and_a_wrong_answer_are_failures_with_their_reason():
    async def dead(pairs):
        raise RuntimeError("replica died")

    g = run(TeacherScoring(dead, deadline_s=5.0), group(sample([-1.0])))
    assert g.meta[TEACHER]["status"] == FAILED and "replica died" in g.meta[TEACHER]["why"]
    g = run(TeacherScoring(score_each_token(float("-inf")), deadline_s=5.0), group(sample([-1.0])))
    assert g.meta[TEACHER]["status"] == FAILED and "not finite" in g.meta[TEACHER]["why"]


def test_a_rejected_row_passes_untouched():
    g = group()
    assert TEACHER not in run(TeacherScoring(score_each_token(0.0), 1.0), g).meta


def test_completion_logprobs_keep_the_outputs_part_of_a_score():
    # score(ids) has len(ids) - 1 entries: entry i predicts ids[i + 1]
    scored = [-9.0, -8.0, -1.0, -2.0]  # prompt of 2 -> entries 1.. predict the 3 outputs
    assert completion_logprobs(scored + [], 2, 3) == [-8.0, -1.0, -2.0]
    import pytest
    with pytest.raises(ValueError, match="scored 4 positions for 2 prompt and 2 output"):
        completion_logprobs(scored, 2, 2)


def test_the_teacher_app_is_named_from_the_jobs_tag_so_the_sweep_finds_it():
    from areal_ray.cluster.ownership import Owned, stale_apps, tag_of_app
    from areal_ray.distill.stage import teacher_app_name
    owned = Owned("0a1b2c3d")
    name = teacher_app_name(owned.app_name)
    assert name == "areal-teacher-0a1b2c3d" and name in owned.app_names
    assert tag_of_app(name) == "0a1b2c3d" and stale_apps([name], frozenset()) == [name]
    with pytest.raises(ValueError, match="'my-app' carries no job tag"):
        teacher_app_name("my-app")
