"""Memory release rounds: before a trainer step on a GPU it shares with rollout
replicas (`rollout.release_memory`), every replica frees its engine's GPU memory and
says so; the next weight push brings the memory back.

A round is an epoch number. The trainer opens one and waits until every replica the
round counts has acknowledged it. Replicas long-poll for a newer epoch, as they do for
weight publications. A round stays open until the next publication (the push that
brings the memory back): a replica that starts while one is open frees its memory at
once, one that starts between rounds keeps it.

Who counts: every replica from `start` or `join` until `forget` (the driver forgets a
replica that unregisters or that its monitor finds dead), whether or not it loaded the
last push: a replica that a push dropped for being slow is still loading, with its
engine's memory back, and it counts as much as one that never answered.

When the wait ends with replicas pending (`unreleased`), the step fails rather than
run: those replicas are alive, and their engines hold their generating share of the
GPU, so the step would run into the OOM the memory plan refused. Waiting longer is no
safer: a replica that does not answer within the push timeout is stuck, and a dead one
needs no patience since the monitor drops it within seconds.

A replica (re)starting while a round is open would size its engine's memory beside
the trainer at its peak (sglang keeps that pool for the rest of the run; vLLM's start
check may fail). It waits for the round to end (`may_start`, at most `start_wait_s`)
before building its engine, and counts for every round from then on (`start`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# What a replica the round waits for is doing, by what the driver knows of it.
STARTING = "starting"  # building its engine (after `start`, before `join`)
LOADING = "loading"    # has not loaded the latest publication (a push may have dropped it)
AWAKE = "awake"        # serves the latest weights and has not freed its memory

DOING = {
    STARTING: "is still starting (building its engine or loading its first weights)",
    LOADING: "is still loading a weight push (the last push may have dropped it as too slow)",
    AWAKE: "serves the latest weights but did not free its memory (its release failed or "
           "hangs: its Serve replica log says 'memory release failed')",
}


class ReleaseTimeout(RuntimeError):
    """Replicas on the trainer's GPU did not free their memory: stepping would OOM."""


class MemoryRelease:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.epoch = 0
        self.open = False  # a trainer step is under way: replicas hold no memory
        self.acked: dict[str, int] = {}  # counted replica -> the last epoch it released for
        self.starting: set[str] = set()  # counted, but not registered yet
        self.opened_at = 0.0
        self.longest_round_s = 0.0  # open to close, of the rounds so far

    def open_round(self) -> int:
        self.epoch += 1
        self.open = True
        self.opened_at = self.clock()
        return self.epoch

    def close_round(self) -> None:
        """A publication: the replicas load it with their memory back."""
        if self.open:
            self.longest_round_s = max(self.longest_round_s, self.clock() - self.opened_at)
        self.open = False

    def first_seen(self) -> int:
        """The epoch a starting replica has already seen: the current one between
        rounds, the one before while a round is open (so it releases now)."""
        return self.epoch - 1 if self.open else self.epoch

    def ack(self, replica_id: str, epoch: int) -> None:
        self.acked[replica_id] = max(epoch, self.acked.get(replica_id, 0))

    def may_start(self) -> bool:
        """Whether a replica may build its engine now: not during a trainer step."""
        return not self.open

    def start_wait_s(self, floor_s: float) -> float:
        """How long a starting replica waits for the round to end: twice the longest
        round so far (steps vary little), at least `floor_s`, so it never waits for good
        on a trainer that is gone."""
        return max(floor_s, 2 * self.longest_round_s)

    def start(self, replica_id: str) -> None:
        """A replica about to build its engine: every round opened from now on waits for
        it (it joins when it registers)."""
        self.acked[replica_id] = self.first_seen()
        self.starting.add(replica_id)

    def join(self, replica_id: str) -> None:
        """A new replica: pending for an open round (it frees its memory at once)."""
        self.acked[replica_id] = self.first_seen()
        self.starting.discard(replica_id)

    def forget(self, replica_id: str) -> None:
        self.acked.pop(replica_id, None)
        self.starting.discard(replica_id)

    def pending(self, replicas: Iterable[str] | None = None) -> list[str]:
        """The replicas (by default every counted one) that have not released for the
        current round."""
        return sorted(r for r in (self.acked if replicas is None else replicas)
                      if self.acked.get(r, 0) < self.epoch)

    def states(self, pending: Iterable[str], served: Iterable[str]) -> dict[str, str]:
        """What each pending replica is doing; `served`: the replicas that loaded the
        latest publication."""
        served = set(served)
        return {r: STARTING if r in self.starting else AWAKE if r in served else LOADING
                for r in pending}

    def newer_than(self, seen: int) -> bool:
        return self.epoch > seen


def unreleased(states: dict[str, str], timeout_s: float) -> ReleaseTimeout | None:
    """The step's verdict once the round's wait ended: None (every counted replica freed
    its memory: step), or the error that fails the step, naming each replica still
    pending, what it is doing, and what to change."""
    if not states:
        return None
    lines = "; ".join(f"replica {r} {DOING[s]}" for r, s in sorted(states.items()))
    slow = {STARTING, LOADING} & set(states.values())
    return ReleaseTimeout(
        f"{len(states)} rollout replica(s) did not free their GPU memory within "
        f"run.push_timeout_s={timeout_s:g} s before this trainer step: {lines}. With "
        f"rollout.release_memory the trainer shares their GPU, so stepping beside an engine "
        f"that holds its generating share would run out of GPU memory; the step fails "
        f"instead. "
        + ("A replica that starts or loads this slowly needs a larger run.push_timeout_s. "
           if slow else "")
        + "If the replicas do not share the trainer's GPUs, set rollout.release_memory=false.")
