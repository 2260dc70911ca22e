"""Publication without Ray: serials, acks, drops, membership epochs, the load slot."""

from dataclasses import dataclass

import pytest

from areal_ray.driver.publication import Publication


@dataclass(frozen=True)
class Broadcast:
    """A payload that admits only the replicas its group was formed with (the shape of
    the collective path's payload, without its transport fields)."""
    members: tuple

    def admits(self, replica_id: str) -> bool:
        return replica_id in self.members


@dataclass(frozen=True)
class Everyone:
    def admits(self, replica_id: str) -> bool:
        return True


def test_a_push_completes_when_every_replica_acked_and_drops_the_late():
    p = Publication()
    p.register("a"), p.register("b")
    p.ack("a", 0), p.ack("b", 0)
    serial = p.announce(1, Everyone()).serial
    assert serial == 1 and p.newer_than(0) and not p.newer_than(1)
    p.ack("a", serial, load_s=0.25)
    assert not p.all_loaded(serial)
    assert p.drop_behind(serial) == ["b"]
    assert p.all_loaded(serial) and p.loaded == {"a": 1}
    assert p.load_time(serial) == 0.25 and p.load_time(7) == 0.0


def test_a_new_replica_loads_the_latest_unless_it_is_a_broadcast_without_it():
    p = Publication()
    assert p.register("a").as_tuple() == (0, 0, None)
    assert p.loaded["a"] == -1  # must load (and ack) serial 0 first
    p.announce(1, Broadcast(("a",)))
    latest = p.register("late")
    assert latest.serial == 1 and p.loaded["late"] == 1  # counts as loaded: takes the next
    assert not p.all_loaded(1)  # "a" still must ack
    p.announce(2, Everyone())
    p.register("c")
    assert p.loaded["c"] == -1


def test_a_rollback_to_an_older_version_is_a_new_serial():
    p = Publication()
    p.announce(3, Everyone())
    assert p.announce(1, Everyone()).as_tuple()[:2] == (2, 1)


def test_a_dropped_replica_that_polls_again_rejoins_at_what_it_has():
    p = Publication()
    p.register("a")
    p.unregister("a")
    p.rejoin("a", 4)
    assert p.loaded == {"a": 4}
    p.rejoin("a", 1)  # already registered: unchanged
    assert p.loaded == {"a": 4}


@pytest.mark.parametrize("changes,epochs", [
    ([], [1, 1]),  # same members: the group is kept
    (["join"], [1, 2]),  # a replica joined: re-formed
    (["leave"], [1, 2]),  # one left: re-formed
    (["forget"], [1, 2]),  # a failed broadcast: re-formed with the live ones
    (["store"], [1, 2]),  # a new trainer rank 0 serves a new store
])
def test_membership_epochs(changes, epochs):
    p = Publication()
    assert p.group_for_push() is None  # no store yet
    p.set_store("h", 1)
    assert p.group_for_push() is None  # no replica yet
    p.register("b"), p.register("a")
    first = p.group_for_push()
    assert first == (1, {"a": 1, "b": 2}, 3)  # rank 0 is the trainer; replicas sorted
    for change in changes:
        {"join": lambda: p.register("c"), "leave": lambda: p.unregister("b"),
         "forget": p.forget_group, "store": lambda: p.set_store("h", 2)}[change]()
    assert [first[0], p.group_for_push()[0]] == epochs


def test_the_load_slot_is_held_by_one_replica_and_freed_by_its_drop():
    p = Publication()
    p.register("a"), p.register("b")
    assert p.slot_free_for("a")
    p.take_slot("a")
    assert p.slot_free_for("a") and not p.slot_free_for("b")
    assert p.release_slot("b") is False
    p.unregister("a")  # died while holding it
    assert p.slot_free_for("b")
    p.take_slot("b")
    assert p.release_slot("b") and p.loader is None


def test_replica_nodes():
    p = Publication()
    p.register("a", "n1"), p.register("b", "n2")
    p.unregister("b")
    assert p.replica_nodes() == {"n1"}


def test_swapping_the_payload_keeps_the_serial_so_nobody_reloads():
    p = Publication()
    p.register("a")
    p.announce(2, Everyone())
    p.ack("a", 1)
    p.swap_payload(Broadcast(("a",)))
    assert p.latest.as_tuple() == (1, 2, Broadcast(("a",))) and p.all_loaded(1)
    assert not p.newer_than(1)
