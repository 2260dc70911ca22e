"""From a Ray Data shard to the exact groups of one training step, on every rank.

A background thread drains this worker's dataset shard as fast as rows arrive
(`prefetch_batches=0`), so no row is ever held back inside Ray Data while the
staleness gate waits for the trainer: with the gate closed, a row stuck in a
prefetch buffer would deadlock the run (STACK_NOTES).

Step t trains exactly the groups with tickets [t*B, (t+1)*B), whichever rank's shard
they arrived on: ranks poll, agree (all-reduce) once all B tickets are present
somewhere, then exchange them (all-gather), so every rank sees the same ordered batch.
"""

from __future__ import annotations

import queue
import threading
import time

import torch.distributed as dist

from areal_ray.types import Group

_DONE = object()


class ShardFeeder:
    def __init__(self, shard):
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, args=(shard,), daemon=True)
        self._thread.start()
        self.exhausted = False

    def _drain(self, shard) -> None:
        try:
            for batch in shard.iter_batches(batch_size=None, prefetch_batches=0, batch_format="numpy"):
                for ticket, blob in zip(batch["ticket"], batch["group"]):
                    self._q.put(Group.from_row({"ticket": int(ticket), "group": blob}))
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
            self._error = e
        finally:
            self._q.put(_DONE)

    def poll(self, timeout_s: float) -> list[Group]:
        """Everything that arrived, waiting up to timeout_s for the first item."""
        items = []
        try:
            items.append(self._q.get(timeout=timeout_s))
            while True:
                items.append(self._q.get_nowait())
        except queue.Empty:
            pass
        if self._error is not None:
            raise RuntimeError("the rollout/reward pipeline failed") from self._error
        if _DONE in items:
            self.exhausted = True
            items = [g for g in items if g is not _DONE]
        return items


class StepAssembler:
    def __init__(self, feeder: ShardFeeder, batch_groups: int, distributed: bool):
        self.feeder = feeder
        self.batch_groups = batch_groups
        self.distributed = distributed
        self.buffer: dict[int, Group] = {}

    def _count(self, n: int) -> int:
        if not self.distributed:
            return n
        import torch
        t = torch.tensor([n, int(self.feeder.exhausted)])
        dist.all_reduce(t)
        self._all_exhausted = int(t[1]) == dist.get_world_size()
        return int(t[0])

    def next_step(self, step: int, poll_s: float = 0.02) -> tuple[list[Group], float]:
        """Ordered groups of `step` and the seconds spent waiting for them."""
        t0 = time.perf_counter()
        lo, hi = step * self.batch_groups, (step + 1) * self.batch_groups
        self._all_exhausted = False
        while True:
            for g in self.feeder.poll(0.0 if self.feeder.exhausted else poll_s):
                if g.ticket in self.buffer:
                    raise RuntimeError(f"ticket {g.ticket} delivered twice")
                self.buffer[g.ticket] = g
            have = [t for t in range(lo, hi) if t in self.buffer]
            total = self._count(len(have))
            if total == hi - lo:
                break
            if (self._all_exhausted if self.distributed else self.feeder.exhausted):
                raise RuntimeError(f"the pipeline ended with step {step} incomplete "
                                   f"({total}/{hi - lo} groups)")
        mine = [self.buffer.pop(t) for t in have]
        if self.distributed:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            mine = [g for part in gathered for g in part]
        return sorted(mine, key=lambda g: g.ticket), time.perf_counter() - t0
