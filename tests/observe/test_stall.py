"""The console says when the pipeline has made no progress for a while, and what it is
waiting on, from the driver's admission counters (a pure policy; the clock is passed)."""

import io

import pytest

from areal_ray.observe.progress import STALL_AFTER_S, Stall, StepProgress, waiting_on

BASE = {"started": 12, "running": 0, "rejected": 0, "version": 3, "closed": False, "eta": 1,
        "batch_groups": 4, "phase": "running", "held": False, "read": 40, "taken": 12, "ahead": 28}


def state(**kw) -> dict:
    return {**BASE, **kw}


def test_silence_is_said_after_a_while_and_again_while_it_lasts():
    stall, s = Stall(60), state(running=2)
    assert stall.check(0, s) is None  # first sight: progress
    assert stall.check(59, s) is None
    line = stall.check(61, s)
    assert line.startswith("[areal-ray] no progress for 61 s (version 3, 12 episodes started, 2 running)")
    assert "waiting on 2 episode(s) in flight" in line
    assert stall.check(100, s) is None  # not every poll
    assert "no progress for 122 s" in stall.check(122, s)


def test_any_progress_restarts_the_clock():
    stall = Stall(60)
    stall.check(0, state())
    assert stall.check(50, state(taken=13)) is None  # a prompt taken
    assert stall.check(100, state(taken=13)) is None  # 50 s since
    assert stall.check(111, state(taken=13)) is not None


def test_a_closed_run_is_not_a_stall():
    stall = Stall(60)
    stall.check(0, state(closed=True, phase="closed"))
    assert stall.check(1000, state(closed=True, phase="closed")) is None


@pytest.mark.parametrize("kw, want", [
    (dict(held=True), "admissions, held"),
    (dict(phase="restoring"), "the trainer to restore its checkpoint"),
    (dict(running=3), "3 episode(s) in flight in the rollout stage"),
    # (version 3 + eta 1 + 1) x 4 groups admitted: the gate waits for a step
    (dict(started=20), "the trainer: the staleness gate is full (20 groups admitted for version 3, algo.eta=1)"),
    (dict(started=22, rejected=4), "the rollout stage to take one of the 28 prompts"),
    (dict(ahead=0), "the prompt reader"),
])
def test_what_the_pipeline_waits_on(kw, want):
    assert waiting_on(state(**kw)).startswith(want)


def test_the_console_gets_the_line_once_the_counters_stand_still():
    out = io.StringIO()
    p = StepProgress(10, stream=out, bar=False)
    p.watch(state(), now=0.0)
    p.watch(state(), now=STALL_AFTER_S - 1)
    assert out.getvalue() == ""
    p.watch(state(), now=STALL_AFTER_S + 1)
    assert out.getvalue().startswith("[areal-ray] no progress for 61 s")


def test_a_run_of_slow_steps_waits_longer_before_it_calls_one_a_stall():
    out = io.StringIO()
    p = StepProgress(10, stream=out, bar=False)
    p.step({"step": 0, "version": 1, "n_tokens": 10, "step_s": 100.0, "reward_mean": 0.5,
            "staleness_max": 0, "staleness_mean": 0.0})
    out.truncate(0), out.seek(0)
    p.watch(state(), now=0.0)
    p.watch(state(), now=150.0)
    assert out.getvalue() == ""  # under 2 x the 100 s step
    p.watch(state(), now=201.0)
    assert "no progress for 201 s" in out.getvalue()


def test_the_seconds_since_progress_grow_with_the_silence_and_restart_with_progress():
    """What the dashboard's gauge shows (areal_seconds_since_progress), between the lines."""
    stall = Stall(60)
    assert stall.quiet_s(5.0) == 0.0  # nothing seen yet
    stall.check(10.0, state())
    assert stall.quiet_s(10.0) == 0.0
    stall.check(40.0, state())
    assert stall.quiet_s(40.0) == 30.0  # said by no line yet: under a minute
    stall.check(45.0, state(version=4))  # a step trained
    assert stall.quiet_s(45.0) == 0.0 and stall.quiet_s(50.0) == 5.0
    stall.check(200.0, state(version=4, closed=True, phase="closed"))
    assert stall.quiet_s(300.0) == 0.0  # a closed run is not stalled


def test_watch_returns_the_seconds_the_console_counts():
    out = io.StringIO()
    p = StepProgress(10, stream=out, bar=False)
    assert p.watch(state(), now=100.0) == 0.0
    assert p.watch(state(), now=130.0) == 30.0
    assert p.watch(state(), now=161.5) == 61.5
    assert "no progress for 62 s" in out.getvalue()  # the line and the gauge agree
