"""Release rounds through the driver actor on a real Ray cluster: a round ends with the
replicas still holding their memory named (a dead one dropped instead), and a replica
starting during a trainer step builds its engine only after it."""

import ray

from areal_ray.driver import Driver
from areal_ray.driver.release import AWAKE, LOADING, STARTING
from areal_ray.weights.payloads import ObjectStorePayload


@ray.remote(num_cpus=0)
class Replica:
    """Stands for a rollout replica's actor: the driver only pings it."""

    def ready(self) -> bool:
        return True


def test_a_round_names_a_live_silent_replica_and_drops_a_dead_one(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1, push_timeout_s=10.0)
    live, dead = Replica.remote(), Replica.remote()
    ray.get([live.ready.remote(), dead.ready.remote()])
    for name, handle in (("live", live), ("dead", dead)):
        ray.get(d.register_replica.remote(name, "", handle))
        ray.get(d.ack.remote(name, 0))
    ray.kill(dead)
    got = ray.get(d.release_replicas.remote(1.0), timeout=30)  # neither acks
    assert got["release_pending"] == {"live": AWAKE}
    assert "dead" not in ray.get(d.replicas.remote())
    assert ray.get(d.release_open.remote())  # until the next publication
    ray.get(d.ack_release.remote("live", 1))
    assert ray.get(d.release_replicas.remote(1.0), timeout=30)["release_pending"] == {"live": AWAKE}


def test_a_replica_a_push_dropped_as_slow_still_counts(ray_cluster):
    """Its load goes on with the engine's memory back: the round must wait for it."""
    d = Driver.remote(eta=0, batch_groups=1, push_timeout_s=0.5)
    for name in ("fast", "slow"):
        ray.get(d.register_replica.remote(name))
        ray.get(d.ack.remote(name, 0))
    push = d.push_weights.remote(1, ObjectStorePayload(ray.put({"w": 1})))
    ray.get(d.ack.remote("fast", 1))
    assert ray.get(push, timeout=30)["dropped"] == ["slow"]
    step = d.release_replicas.remote(0.5)
    ray.get(d.ack_release.remote("fast", 1))
    assert ray.get(step, timeout=30)["release_pending"] == {"slow": LOADING}


def test_a_replica_starting_during_a_step_waits_for_the_publication(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1, push_timeout_s=10.0)
    assert ray.get(d.replica_starting.remote("first"), timeout=10) is None  # between steps
    ray.get(d.register_replica.remote("first"))
    ray.get(d.ack.remote("first", 0))
    step = d.release_replicas.remote(5.0)
    ray.get(d.ack_release.remote("first", 1))
    assert ray.get(step, timeout=30)["release_pending"] == {}
    starting = d.replica_starting.remote("second")
    assert not ray.wait([starting], timeout=0.5)[0]  # the trainer's step is under way
    push = d.push_weights.remote(1, ObjectStorePayload(ray.put({"w": 1})))
    assert ray.get(starting, timeout=10) is None  # the publication ended the round
    ray.get(d.ack.remote("first", 1))
    ray.get(push, timeout=30)
    # the next round waits for it while it builds its engine
    got = ray.get(d.release_replicas.remote(0.5), timeout=30)
    assert got["release_pending"] == {"first": AWAKE, "second": STARTING}
