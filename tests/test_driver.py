"""The driver actor on a real Ray cluster: gate waits, pushes wait for replica acks."""

import ray

from areal_ray.driver import Driver


def test_acquire_waits_for_a_push_and_close_releases_waiters(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=2)
    assert sorted(ray.get([d.acquire.remote(), d.acquire.remote()])) == [(0, 0), (1, 0)]
    blocked = d.acquire.remote()
    ready, _ = ray.wait([blocked], timeout=0.5)
    assert not ready  # eta = 0: the next batch waits for version 1
    ray.get([d.finish.remote(), d.finish.remote()])
    assert ray.get(d.push_weights.remote(1, [ray.put({"w": 1})]))["replicas"] == 0
    assert ray.get(blocked, timeout=10) == (2, 1)
    assert ray.get(d.acquire.remote(), timeout=10) == (3, 1)
    waiting = d.acquire.remote()  # the gate is full again
    assert not ray.wait([waiting], timeout=0.5)[0]
    ray.get(d.close.remote())
    assert ray.get(waiting, timeout=10) is None  # closing releases waiters
    assert ray.get(d.acquire.remote(), timeout=10) is None


def test_push_waits_for_acks_and_drops_a_silent_replica(ray_cluster):
    d = Driver.remote(eta=1, batch_groups=1, push_timeout_s=1.0)
    assert ray.get(d.register_replica.remote("a")) == (0, None)
    ray.get(d.register_replica.remote("b"))
    ray.get([d.ack.remote("a", 0), d.ack.remote("b", 0)])
    push = d.push_weights.remote(1, [ray.put({"w": 2})])
    version, weights = ray.get(d.wait_for_weights.remote("a", 0, 5.0))
    assert version == 1 and ray.get(weights[0]) == {"w": 2}
    ray.get(d.ack.remote("a", 1))  # "b" never acks
    rec = ray.get(push, timeout=10)
    assert rec["dropped"] == ["b"] and ray.get(d.version.remote()) == 1
    assert ray.get(d.replicas.remote()) == {"a": 1}
    # a replica that registers later gets the latest weights at once
    assert ray.get(d.register_replica.remote("c"))[0] == 1
