"""Memory release rounds (areal_ray/driver/release.py)."""

import pytest

from areal_ray.driver.release import (
    AWAKE,
    LOADING,
    STARTING,
    MemoryRelease,
    ReleaseTimeout,
    unreleased,
)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def play(r, events):
    for ev in events:
        if ev == "open":
            r.open_round()
        elif ev == "close":
            r.close_round()
        else:
            getattr(r, ev[0])(*ev[1:])
    return r


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
    assert play(MemoryRelease(), events).pending(replicas) == pending


@pytest.mark.parametrize("events, pending", [
    ([("join", "a"), ("join", "b"), "open"], ["a", "b"]),
    # every counted replica, also one the last push dropped (publication.drop_behind):
    # it is still loading, with its engine's memory back
    ([("join", "a"), ("join", "b"), "open", ("ack", "a", 1)], ["b"]),
    ([("join", "a"), ("join", "b"), ("forget", "b"), "open"], ["a"]),  # unregistered or dead
    ([("start", "s"), "open"], ["s"]),  # building its engine: the round waits for it
    ([("start", "s"), "open", ("join", "s")], ["s"]),  # registered mid-round: frees at once
    ([("start", "s"), "open", ("join", "s"), ("ack", "s", 1)], []),
    ([("start", "s"), ("forget", "s"), "open"], []),  # died while starting
])
def test_a_round_counts_every_replica_until_it_is_forgotten(events, pending):
    assert play(MemoryRelease(), events).pending() == pending


@pytest.mark.parametrize("events, served, states", [
    ([("start", "s"), "open"], [], {"s": STARTING}),
    ([("start", "s"), ("join", "s"), "open"], [], {"s": LOADING}),  # first load not acked
    ([("join", "a"), "open"], [], {"a": LOADING}),  # dropped by the last push
    ([("join", "a"), "open"], ["a"], {"a": AWAKE}),  # loaded it, never released
    ([("join", "a"), ("join", "b"), "open", ("ack", "b", 1)], ["a", "b"], {"a": AWAKE}),
])
def test_pending_replicas_say_what_they_are_doing(events, served, states):
    r = play(MemoryRelease(), events)
    assert r.states(r.pending(), served) == states


def test_every_replica_freed_its_memory_lets_the_step_run():
    assert unreleased({}, 300.0) is None


@pytest.mark.parametrize("states, says, slow", [
    ({"r1": AWAKE}, ["replica r1 serves the latest weights but did not free its memory",
                     "memory release failed"], False),
    ({"r1": LOADING}, ["replica r1 is still loading a weight push"], True),
    ({"r2": STARTING, "r1": AWAKE}, ["2 rollout replica(s)", "replica r1 serves",
                                     "replica r2 is still starting"], True),
])
def test_a_replica_still_pending_fails_the_step_naming_it(states, says, slow):
    """Stepping beside an engine that holds its generating share is an OOM on a shared
    GPU: the step fails, naming each replica, what it does, and what to change."""
    error = unreleased(states, 300.0)
    assert isinstance(error, ReleaseTimeout)
    msg = str(error)
    for text in says + ["run.push_timeout_s=300 s", "rollout.release_memory=false"]:
        assert text in msg
    assert ("needs a larger run.push_timeout_s" in msg) == slow


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


@pytest.mark.parametrize("rounds_s, floor_s, wait_s", [
    ([], 300.0, 300.0),              # no round yet: the floor
    ([10.0, 40.0], 300.0, 300.0),    # short steps: the floor
    ([200.0, 500.0, 100.0], 300.0, 1000.0),  # twice the longest step
])
def test_a_starting_replica_waits_for_the_step_at_most_twice_the_longest_round(
        rounds_s, floor_s, wait_s):
    clock = Clock()
    r = MemoryRelease(clock)
    assert r.may_start()
    for length in rounds_s:
        r.open_round()
        assert not r.may_start()  # a trainer step is under way
        clock.t += length
        r.close_round()
        assert r.may_start()
        clock.t += 1000.0  # between rounds does not count
    r.close_round()  # a publication outside a round (the first push) measures nothing
    assert r.start_wait_s(floor_s) == wait_s
