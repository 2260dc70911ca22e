"""areal_ray/observe/metrics.py: rates and shares a replica derives from its engine's counters,
and a driver's step record accepted as recorded (export itself is checked end to end
in tests/jobs/test_submit.py, on a real metrics endpoint)."""

import pytest

from areal_ray.observe.metrics import METRICS, DriverMetrics, JobMetrics, ReplicaMetrics
from areal_ray.observe.utilization import rollout_idle


def test_replica_rates_come_from_counter_deltas(ray_cluster):
    m = ReplicaMetrics("t", "r1")
    first = m.sample({"running": 3, "queued": 1, "tokens": 100, "busy_s": 1.0}, now=10.0)
    assert first == {"running": 3, "queued": 1}  # no interval yet: no rates
    out = m.sample({"running": 2, "queued": 0, "tokens": 500, "busy_s": 2.5}, now=12.0)
    assert out["tokens_per_s"] == pytest.approx(200.0)
    assert out["idle_fraction"] == pytest.approx(0.25)  # busy 1.5 s of 2 s


def test_engines_without_a_busy_clock_are_sampled(ray_cluster):
    m = ReplicaMetrics("t", "r2")
    m.sample({"running": 0, "queued": 0, "tokens": 0}, now=0.0)
    out = m.sample({"running": 1, "queued": 0, "tokens": 30}, now=1.0)
    assert out["idle_fraction"] == pytest.approx(0.5)  # one idle sample of two
    assert out["tokens_per_s"] == pytest.approx(30.0)


def test_the_live_gauge_and_the_run_summary_agree(ray_cluster):
    """The same two reports give a replica's gauge and the summary the same idle share."""
    loads = [(5.0, {"running": 1, "queued": 0, "tokens": 0, "busy_s": 3.0}),
             (9.0, {"running": 0, "queued": 0, "tokens": 80, "busy_s": 4.0})]
    m = ReplicaMetrics("t", "r3")
    live = [m.sample(load, now=t) for t, load in loads][-1]
    summary = rollout_idle({"r3": [{"time": t, **load} for t, load in loads]}, 0.0, 10.0)
    assert live["idle_fraction"] == summary["rollout_idle_fraction"] == pytest.approx(0.75)
    assert live["tokens_per_s"] == summary["generation_tokens_per_s"] == pytest.approx(20.0)


def test_driver_records_a_step_and_pool_sizes(ray_cluster):
    """Ray checks tags and values as they are recorded: a wrong tag set raises here."""
    m = DriverMetrics("t")
    m.step({"version": 3, "n_samples": 16, "n_tokens": 800, "reward_mean": 0.5,
            "staleness_hist": {"0": 10, "2": 6}, "push_gather_s": 0.1, "push_transfer_s": 0.2,
            "push_load_s": 0.3, "push_total_s": 0.7, "step_s": 2.0, "wait_s": 0.5,
            "entropy": 2.5, "mismatch_k3": 0.01, "correction_masked_frac": None})
    m.replicas(2)
    m.reward_actors(1)


def test_the_job_records_the_seconds_since_progress(ray_cluster):
    JobMetrics("t").since_progress(61.5)
    JobMetrics("").since_progress(0.0)  # a run without a name is tagged "areal"


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_is_documented(name):
    """docs/running.md's metrics table (moved there from the README) names each one."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "running.md").read_text()
    assert f"`ray_{name}" in doc
