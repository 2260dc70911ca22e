"""Memory release rounds (areal_ray/driver/release.py)."""

import pytest

from areal_ray.driver.release import MemoryRelease


@pytest.mark.parametrize("events, replicas, pending", [
    ([], ["a", "b"], []),  # no round yet
    (["open"], ["a", "b"], ["a", "b"]),
    (["open", ("ack", "a", 1)], ["a", "b"], ["b"]),
    (["open", ("ack", "a", 1), ("ack", "b", 1)], ["a", "b"], []),
    (["open", ("ack", "a", 1), "open"], ["a"], ["a"]),  # a new round needs a new ack
    (["open", ("join", "c")], ["c"], ["c"]),  # joins during a step: it must free its memory
    (["open", "close", ("join", "c")], ["c"], []),  # joins between steps: it keeps it
    (["open", ("ack", "a", 1), ("ack", "a", 0)], ["a"], []),  # a stale ack never undoes one
    (["open", ("forget", "b")], ["a"], ["a"]),
])
def test_release_rounds(events, replicas, pending):
    r = MemoryRelease()
    for ev in events:
        if ev == "open":
            r.open_round()
        elif ev == "close":
            r.close_round()
        else:
            getattr(r, ev[0])(*ev[1:])
    assert r.pending(replicas) == pending


def test_newer_than_wakes_long_polls_once_per_round():
    r = MemoryRelease()
    assert not r.newer_than(0)
    assert r.open_round() == 1 and r.newer_than(0) and not r.newer_than(1)


@pytest.mark.parametrize("events, seen", [([], 0), (["open"], 0), (["open", "close"], 1),
                                          (["open", "close", "open"], 1)])
def test_a_starting_replica_releases_only_inside_an_open_round(events, seen):
    r = MemoryRelease()
    for ev in events:
        r.open_round() if ev == "open" else r.close_round()
    assert r.first_seen() == seen
