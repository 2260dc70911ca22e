"""The local cluster a job starts bounds the GCS's task events (cluster/system_config.py)."""

import pytest

from areal_ray.config import Config
from areal_ray.run import job as run

pytestmark = pytest.mark.unit


def test_a_local_cluster_keeps_a_bounded_number_of_task_events(monkeypatch):
    seen = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(run.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(run.ray, "init", lambda **kw: seen.update(kw))
    cfg = Config()
    cfg.run.task_events_kept = 1234
    cfg.run.inline_result_bytes = 2048
    run.init_ray(cfg)
    assert seen["address"] == "local"
    assert seen["_system_config"] == {
        "task_events_max_num_task_in_gcs": 1234,
        "task_events_max_dropped_task_attempts_tracked_per_job_in_gcs": 12340,
        # Ray Data's blocks through the object store, not inline into the coordinator
        "max_direct_call_object_size": 2048}


def test_a_joined_cluster_keeps_its_own_settings(monkeypatch):
    seen = {}
    monkeypatch.setattr(run.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(run.ray, "init", lambda **kw: seen.update(kw))
    cfg = Config()
    cfg.run.ray_address = "ray://head:10001"
    run.init_ray(cfg)
    assert "_system_config" not in seen  # Ray refuses it when joining a running cluster
