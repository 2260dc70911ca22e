"""Memory release rounds: before a trainer step on a GPU it shares with rollout
replicas (`rollout.release_memory`), every replica frees its engine's GPU memory and
says so; the next weight push brings the memory back.

A round is an epoch number. The trainer opens one and waits until every registered
replica has acknowledged it (or the timeout, after which it steps anyway and the
record says which replicas did not answer: a dead replica is dropped by the monitor,
and a slow one must not stall training for good). Replicas long-poll for a newer epoch,
as they do for weight publications. A round stays open until the next publication
(the push that brings the memory back): a replica that starts while one is open frees
its memory at once, one that starts between rounds keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable


class MemoryRelease:
    def __init__(self):
        self.epoch = 0
        self.open = False  # a trainer step is under way: replicas hold no memory
        self.acked: dict[str, int] = {}  # replica id -> the last epoch it released for

    def open_round(self) -> int:
        self.epoch += 1
        self.open = True
        return self.epoch

    def close_round(self) -> None:
        """A publication: the replicas load it with their memory back."""
        self.open = False

    def first_seen(self) -> int:
        """The epoch a starting replica has already seen: the current one between
        rounds, the one before while a round is open (so it releases now)."""
        return self.epoch - 1 if self.open else self.epoch

    def ack(self, replica_id: str, epoch: int) -> None:
        self.acked[replica_id] = max(epoch, self.acked.get(replica_id, 0))

    def join(self, replica_id: str) -> None:
        """A new replica: pending for an open round (it frees its memory at once)."""
        self.acked[replica_id] = self.first_seen()

    def forget(self, replica_id: str) -> None:
        self.acked.pop(replica_id, None)

    def pending(self, replicas: Iterable[str]) -> list[str]:
        """The replicas that have not released for the current round."""
        return sorted(r for r in replicas if self.acked.get(r, 0) < self.epoch)

    def newer_than(self, seen: int) -> bool:
        return self.epoch > seen
