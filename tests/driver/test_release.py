"""Memory release rounds (areal_ray/driver/release.py)."""

import pytest

from areal_ray.driver.release import MemoryRelease


@pytest.mark.parametrize("events, replicas, pending", [
    ([], ["a", "b"], []),  # no round yet
    (["open"], ["a", "b"], ["a", "b"]),
    (["open", ("ack", "a", 1)], ["a", "b"], ["b"]),
    (["open", ("ack", "a", 1), ("ack", "b", 1)], ["a", "b"], []),
    (["open", ("ack", "a", 1), "open"], ["a"], ["a"]),  # a new round needs a new ack
    (["open", ("join", "c")], ["c"], []),  # a replica that joins mid-round has nothing to free
    (["open", ("ack", "a", 1), ("ack", "a", 0)], ["a"], []),  # a stale ack never undoes one
    (["open", ("forget", "b")], ["a"], ["a"]),
])
def test_release_rounds(events, replicas, pending):
    r = MemoryRelease()
    for ev in events:
        if ev == "open":
            r.open_round()
        else:
            getattr(r, ev[0])(*ev[1:])
    assert r.pending(replicas) == pending


def test_newer_than_wakes_long_polls_once_per_round():
    r = MemoryRelease()
    assert not r.newer_than(0)
    assert r.open_round() == 1 and r.newer_than(0) and not r.newer_than(1)
