"""The driver actor on a real Ray cluster: gate waits, pushes wait for replica acks."""

import ray

from areal_ray.driver import Driver
from areal_ray.weights.payloads import CollectivePayload, DiskPayload, ObjectStorePayload
from areal_ray.weights.tensor_spec import TensorSpec


def test_acquire_waits_for_a_push_and_close_releases_waiters(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=2)
    assert sorted(ray.get([d.acquire.remote(), d.acquire.remote()])) == [(0, 0), (1, 0)]
    blocked = d.acquire.remote()
    ready, _ = ray.wait([blocked], timeout=0.5)
    assert not ready  # eta = 0: the next batch waits for version 1
    ray.get([d.finish.remote(), d.finish.remote()])
    assert ray.get(d.push_weights.remote(1, ObjectStorePayload(ray.put({"w": 1}))))["replicas"] == 0
    assert ray.get(blocked, timeout=10) == (2, 1)
    assert ray.get(d.acquire.remote(), timeout=10) == (3, 1)
    waiting = d.acquire.remote()  # the gate is full again
    assert not ray.wait([waiting], timeout=0.5)[0]
    ray.get(d.close.remote())
    assert ray.get(waiting, timeout=10) is None  # closing releases waiters
    assert ray.get(d.acquire.remote(), timeout=10) is None


def test_a_held_driver_admits_only_after_the_release(ray_cluster):
    d = Driver.remote(eta=1, batch_groups=1, held=True)
    waiting = d.acquire.remote()
    assert not ray.wait([waiting], timeout=0.5)[0]  # held: nothing is generated yet
    ray.get(d.release_admissions.remote())
    assert ray.get(waiting, timeout=10) == (0, 0)


def test_push_waits_for_acks_and_drops_a_silent_replica(ray_cluster):
    d = Driver.remote(eta=1, batch_groups=1, push_timeout_s=1.0)
    assert ray.get(d.register_replica.remote("a")) == (0, 0, None)
    ray.get(d.register_replica.remote("b"))
    ray.get([d.ack.remote("a", 0), d.ack.remote("b", 0)])
    push = d.push_weights.remote(1, ObjectStorePayload(ray.put({"w": 2})))
    serial, version, weights = ray.get(d.wait_for_weights.remote("a", 0, 5.0))
    assert (serial, version) == (1, 1) and ray.get(weights.ref) == {"w": 2}
    ray.get(d.ack.remote("a", serial))  # "b" never acks
    rec = ray.get(push, timeout=10)
    assert rec["dropped"] == ["b"] and ray.get(d.version.remote()) == 1
    assert ray.get(d.replicas.remote()) == {"a": 1}
    # a replica that registers later gets the latest weights at once
    assert ray.get(d.register_replica.remote("c"))[:2] == (1, 1)


def test_new_generation_pauses_until_restore_which_rolls_weights_back(ray_cluster):
    """A trainer restart: the old pipeline's calls become no-ops, admissions wait for
    restore(), a rollback to an older version is a new publication replicas must load,
    and consumed prompt positions are skipped."""
    d = Driver.remote(eta=0, batch_groups=2, push_timeout_s=10.0)
    ray.get(d.register_replica.remote("a"))
    ray.get(d.ack.remote("a", 0))
    assert [ray.get(d.acquire.remote(p)) for p in (0, 1)] == [(0, 0), (1, 0)]
    ray.get(d.finish.remote()), ray.get(d.finish.remote())
    pushed = d.push_weights.remote(1, ObjectStorePayload(ray.put({"w": 1})))
    ray.get(d.ack.remote("a", 1))
    ray.get(pushed)

    gen = ray.get(d.begin_generation.remote())
    assert ray.get(d.acquire.remote(2, 0)) is None  # the old pipeline is cut off
    waiting = d.acquire.remote(2, gen)
    assert not ray.wait([waiting], timeout=0.5)[0]  # paused until restore
    rollback = ObjectStorePayload(ray.put({"w": 0}))
    restored = d.restore.remote(0, 0, 0, [0], rollback)  # roll back to version 0
    serial, version, weights = ray.get(d.wait_for_weights.remote("a", 1, 5.0))
    assert (serial, version) == (2, 0) and ray.get(weights.ref) == {"w": 0}
    assert not ray.wait([restored], timeout=0.3)[0]  # waits for the replica's ack
    ray.get(d.ack.remote("a", serial))
    assert ray.get(restored, timeout=10)["published"]
    assert ray.get(waiting, timeout=10) == (0, 0)  # tickets restart at the checkpoint's
    assert ray.get(d.acquire.remote(0, gen)) is None  # position 0 was consumed
    assert ray.get(d.steps.remote())[-1] == {"event": "restore", "version": 0, "records": []}


def test_events_read_by_the_job_are_let_go(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1)
    for _ in range(3):  # each restore is an event
        ray.get(d.restore.remote(0))
    assert len(ray.get(d.steps.remote(0))) == 3
    assert len(ray.get(d.steps.remote(2))) == 1
    ray.get(d.restore.remote(0))
    assert len(ray.get(d.steps.remote(3))) == 1  # `since` counts in the run's order
    assert len(ray.get(d.steps.remote(0))) == 1  # what was read before is gone
    assert ray.get(d.steps.remote(4)) == []
    ray.kill(d)


def test_consumed_positions_are_told_after_the_restore(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1)
    gen = ray.get(d.begin_generation.remote())
    told = d.consumed_between.remote(10, 20)
    assert not ray.wait([told], timeout=0.3)[0]  # the checkpoint is not restored yet
    ray.get(d.restore.remote(0, 0, 0, [3, 12, 15, 25]))
    assert ray.get(told, timeout=10) == [12, 15]
    assert gen == 1
    ray.kill(d)


def test_the_reader_waits_while_far_ahead_of_the_rollout_stage(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1)
    gen = ray.get(d.begin_generation.remote())
    ray.get(d.restore.remote(0))
    ray.get(d.read_ahead.remote(gen, 3, 4), timeout=10)  # 3 ahead: goes on
    blocked = d.read_ahead.remote(gen, 3, 4)  # 6 ahead
    assert not ray.wait([blocked], timeout=0.3)[0]
    assert ray.get(d.acquire.remote(0, gen)) == (0, 0)  # taken: 5 ahead, still waiting
    assert not ray.wait([blocked], timeout=0.3)[0]
    _waiting_at_gate = d.acquire.remote(1, gen)  # the gate is full (eta 0, B 1) ...
    assert ray.get(blocked, timeout=10) is None  # ... but the prompt counts as taken
    assert ray.get(d.read_state.remote()) == {"read": 6, "taken": 2, "ahead": 4}
    assert ray.get(d.read_ahead.remote(gen - 1, 100, 0), timeout=10) is None  # an old pipeline
    ray.kill(d)


def test_rejected_groups_free_their_slots(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1)
    assert ray.get(d.acquire.remote()) == (0, 0)
    ray.get(d.finish.remote())
    blocked = d.acquire.remote()
    assert not ray.wait([blocked], timeout=0.3)[0]
    ray.get(d.reject.remote(1))
    assert ray.get(blocked, timeout=10) == (1, 0)


def test_replica_load_reports_are_kept_per_replica(ray_cluster):
    d = Driver.remote(eta=0, batch_groups=1)
    refs = [d.report_load.remote("a", {"time": float(i), "busy_s": i / 2, "tokens": 10 * i,
                                       "running": 1, "queued": 0}) for i in range(5)]
    refs.append(d.report_load.remote("b", {"time": 0.0, "busy_s": None, "tokens": 0,
                                           "running": 0, "queued": 0}))
    ray.get(refs)
    loads = ray.get(d.replica_loads.remote())
    # a concurrent actor may run calls out of order: readers sort by time (utilization.py)
    assert sorted(r["time"] for r in loads["a"]) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(loads["b"]) == 1
    ray.kill(d)


def test_the_driver_keeps_the_last_object_store_weights_past_the_trainer(ray_cluster):
    d = Driver.remote(eta=1, batch_groups=1)
    assert ray.get(d.latest_weights.remote()) == (0, None)  # the model on disk
    ray.get(d.push_weights.remote(1, ObjectStorePayload(ray.put({"w": 1}))))
    ray.get(d.close.remote())
    version, refs = ray.get(d.latest_weights.remote())
    assert version == 1 and ray.get(refs[0]) == {"w": 1}


def test_close_republishes_the_final_weights_of_another_path(ray_cluster):
    d = Driver.remote(eta=1, batch_groups=1)
    ray.get(d.push_weights.remote(1, DiskPayload("/tmp/v1.safetensors")))
    assert ray.get(d.latest_weights.remote()) == (1, None)  # not in the object store
    ray.get(d.close.remote(ObjectStorePayload(ray.put({"w": 1}))))
    serial, version, payload = ray.get(d.wait_for_weights.remote("late", 1, 5.0))
    assert (serial, version) == (2, 1) and ray.get(payload.ref) == {"w": 1}
    assert ray.get(ray.get(d.latest_weights.remote())[1][0]) == {"w": 1}


def test_a_replica_registering_during_a_broadcast_does_not_hold_up_its_acks(ray_cluster):
    d = Driver.remote(eta=1, batch_groups=1, push_timeout_s=10.0)
    ray.get(d.register_replica.remote("a"))
    ray.get(d.ack.remote("a", 0))
    ray.get(d.set_weight_store.remote("127.0.0.1", 1234))
    plan = ray.get(d.begin_push.remote(1, [TensorSpec("w", (1,), "float32")], 4096))
    serial, _, payload = ray.get(d.register_replica.remote("late"))
    assert isinstance(payload, CollectivePayload) and payload.ranks == {"a": 1}
    assert serial == plan["serial"] and not payload.admits("late")
    assert ray.get(d.replicas.remote())["late"] == serial  # counted as having loaded it
    ray.get(d.ack.remote("a", serial))
    assert ray.get(d.end_push.remote(1, serial), timeout=10)["dropped"] == []


def test_a_push_whose_load_probe_disagrees_with_the_trainers_fails_naming_the_replica(ray_cluster):
    """weights/probe.py through the actor: the trainer's expected probe, a replica's ack
    carrying its own; a replica still computing with the previous version fails the push."""
    import pytest

    from areal_ray.weights.probe import ProbeMismatch, ProbeRule
    d = Driver.remote(eta=1, batch_groups=1, push_timeout_s=10.0, probe=ProbeRule(atol=1e-5))
    ray.get(d.register_replica.remote("a"))
    ray.get(d.ack.remote("a", 0))  # the model on disk: nothing expected, nothing checked
    ids, v1, v2 = [3, 4, 5], [-1.0, -2.0], [-1.0, -2.5]

    def push(version, expected, replica_probe):
        ray.get(d.expect_probe.remote(version, ids, expected))
        pushed = d.push_weights.remote(version, ObjectStorePayload(ray.put({"w": version})))
        serial, got, _ = ray.get(d.wait_for_weights.remote("a", version - 1, 5.0))
        assert got == version
        ray.get(d.ack.remote("a", serial, 0.1, (ids, replica_probe)))
        return ray.get(pushed, timeout=10)

    rec = push(1, v1, v1)
    assert (rec["probe_max_diff"], rec["probe_signal"]) == (0.0, None)
    with pytest.raises(ProbeMismatch, match=r"replica a does not serve v2: .* up to 0.5 "
                                            r"\(tolerance 1e-05\).* one step moved them by 0.5"):
        push(2, v2, v1)  # acked, but still computing v1's logprobs
