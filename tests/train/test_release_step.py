"""The trainer's side of release rounds (train/loop.py): a step never runs beside a
replica that still holds its GPU memory, and a trainer restarted inside a round
publishes, since the replicas get their memory back only at a publication."""

import pytest
import ray

from areal_ray.config import load_config
from areal_ray.driver import Driver
from areal_ray.driver.release import ReleaseTimeout
from areal_ray.train.loop import must_publish, release_replicas


def test_a_replica_that_keeps_its_memory_fails_the_step(ray_cluster):
    cfg = load_config(None, ["rollout.release_memory=true", "run.push_timeout_s=0.5"])
    d = Driver.remote(eta=0, batch_groups=1, push_timeout_s=10.0)
    ray.get(d.register_replica.remote("r1"))
    ray.get(d.ack.remote("r1", 0))
    with pytest.raises(ReleaseTimeout, match="replica r1 serves the latest weights"):
        release_replicas(d, cfg)
    assert must_publish(d, cfg, start=0)  # the failed step's round is open
    assert not must_publish(d, load_config(None, ["run.push_timeout_s=0.5"]), start=0)


def test_a_released_fleet_lets_the_step_run(ray_cluster):
    cfg = load_config(None, ["rollout.release_memory=true", "run.push_timeout_s=5"])
    d = Driver.remote(eta=0, batch_groups=1, push_timeout_s=10.0)
    assert not must_publish(d, cfg, start=0)
    assert release_replicas(d, cfg)["release_pending"] == 0  # no replica: nothing to wait for
