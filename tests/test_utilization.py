"""Idle fractions, steady-state throughput and length tails from run records."""

import pytest

from areal_ray.utilization import length_stats, percentile, rollout_idle, steady_state


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


def test_rollout_idle_needs_two_reports():
    assert rollout_idle({"a": [report(1, 0, 0)]}, 0, 10) == {}
    assert rollout_idle({}, 0, 10) == {}
