"""Idle fractions, steady-state throughput and length tails from run records."""

import pytest

from areal_ray.observe.utilization import (
    interval_rates,
    length_stats,
    percentile,
    rollout_idle,
    steady_state,
    thin,
)


@pytest.mark.parametrize("q,expected", [(0, 1), (50, 5), (90, 9), (99, 10), (100, 10)])
def test_percentile_nearest_rank(q, expected):
    assert percentile(list(range(10, 0, -1)), q) == expected


def test_length_stats_shows_the_tail():
    lens = [10] * 98 + [200, 400]
    s = length_stats(lens)
    assert s["output_len_p50"] == 10 and s["output_len_p90"] == 10
    assert s["output_len_p99"] == 200 and s["output_len_max"] == 400
    assert s["output_len_mean"] == pytest.approx(15.8)
    assert length_stats([]) == {}


def step(t, step_s, wait_s, n=8, tokens=80, train_s=0.5):
    return {"time_s": t, "step_s": step_s, "wait_s": wait_s, "n_samples": n,
            "n_tokens": tokens, "train_s": train_s}


def test_steady_state_leaves_out_the_first_step():
    # the first step carries 20 s of start-up; then 3 steps of 2 s, half of it waiting
    steps = [step(20.0, 20.0, 19.0), step(22.0, 2.0, 1.0), step(24.0, 2.0, 1.0), step(26.0, 2.0, 1.0)]
    s = steady_state(steps)
    assert s["steady_s"] == 6.0
    assert s["steady_samples_per_s"] == pytest.approx(24 / 6)
    assert s["steady_tokens_per_s"] == pytest.approx(240 / 6)
    assert s["trainer_idle_fraction"] == pytest.approx(0.5)
    assert s["step_s_mean"] == pytest.approx(2.0)
    assert steady_state(steps[:1]) == {}


def report(t, busy, tokens, running=1, queued=0):
    return {"time": t, "busy_s": busy, "tokens": tokens, "running": running, "queued": queued}


def test_rollout_idle_from_the_busy_clock_inside_the_window():
    reports = {
        # busy 3 of the 4 s inside [10, 20]; the reports outside the window are ignored
        "a": [report(5, 0, 0), report(12, 1, 100), report(14, 2, 200), report(16, 4, 400),
              report(25, 20, 2000)],
        # busy 1 of 4 s
        "b": [report(15, 1, 40), report(11, 0, 0)],  # out of order: sorted by time
    }
    s = rollout_idle(reports, 10, 20)
    assert s["rollout_idle_fraction"] == pytest.approx((1 + 3) / (4 + 4))
    assert s["generation_tokens_per_s"] == pytest.approx(300 / 4 + 40 / 4)


def test_rollout_idle_without_a_busy_clock_samples_the_queue():
    rows = [report(0, None, 0, running=0), report(1, None, 10, running=2),
            report(2, None, 20, running=0, queued=3), report(3, None, 20, running=0)]
    s = rollout_idle({"sglang": rows}, 0, 3)
    assert s["rollout_idle_fraction"] == pytest.approx(0.5)


def test_interval_rates_between_two_reports():
    # busy 1.5 s of 2 s, 400 tokens: the clock decides, the samples do not
    idle = [report(0, None, 0, running=0)]
    assert interval_rates(report(10, 1.0, 100), report(12, 2.5, 500), idle) == \
        pytest.approx({"idle_fraction": 0.25, "tokens_per_s": 200.0})
    # no clock: one of the four samples had nothing running or queued
    rows = [report(0, None, 0, running=0), report(1, None, 5), report(2, None, 5, running=0, queued=1),
            report(4, None, 20)]
    assert interval_rates(rows[0], rows[-1], rows) == \
        pytest.approx({"idle_fraction": 0.25, "tokens_per_s": 5.0})
    assert interval_rates(report(3, 1, 0), report(3, 2, 9), []) == {}  # no time passed


def test_rollout_idle_needs_two_reports():
    assert rollout_idle({"a": [report(1, 0, 0)]}, 0, 10) == {}
    assert rollout_idle({}, 0, 10) == {}


def test_thinned_reports_stay_bounded_and_keep_the_idle_fraction():
    """The driver's bound: thinning whenever a replica has more than `cap` reports keeps
    at most `cap` of them, the last one always, and the same idle fraction."""
    cap, full, kept = 100, [], []
    busy = 0.0
    for i in range(5000):  # a report every 2 s; the engine busy 3 s of every 4
        busy += 2.0 if (i // 1) % 2 == 0 else 1.0
        r = {"time": 2.0 * i, "busy_s": busy, "tokens": 10 * i, "running": 1, "queued": 0}
        full.append(r)
        kept.append(r)
        if len(kept) > cap:
            kept = thin(kept)
    assert len(kept) <= cap and kept[-1] is full[-1] and kept[0] is full[0]
    t0, t1 = 100.0, full[-1]["time"]
    exact = rollout_idle({"r": full}, t0, t1)["rollout_idle_fraction"]
    approx = rollout_idle({"r": kept}, t0, t1)["rollout_idle_fraction"]
    assert exact == pytest.approx(0.25, abs=0.01)
    assert approx == pytest.approx(exact, abs=0.02)
