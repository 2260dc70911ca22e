"""From a Ray Data shard to the exact groups of one training step, on every rank.

A background thread drains this worker's dataset shard as fast as rows arrive
(`prefetch_batches=0`), so no row is ever held back inside Ray Data while the
staleness gate waits for the trainer: with the gate closed, a row stuck in a
prefetch buffer would deadlock the run (docs/stack_facts.md).

Step t trains the next B accepted groups in ticket order (without a dynamic filter:
exactly the tickets [t*B, (t+1)*B)), whichever rank's shard they arrived on: ranks
poll and share what arrived (ticket, verdict, position) every round, so all of them
walk the same ticket sequence, then exchange the chosen groups (all-gather) and see
the same ordered batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from areal_ray.distill.advantage import dropped as teacher_dropped
from areal_ray.rollout.workflows.base import is_abandoned
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


@dataclass
class StepBatch:
    groups: list[Group]  # the step's B accepted groups, in ticket order
    rejected: list[int]  # prompt positions of the groups the filter dropped on the way
    wait_s: float
    abandoned: int = 0  # of the rejected: rows whose episode passed rollout.episode_timeout_s
    teacher_dropped: int = 0  # of the rejected: groups the distillation teacher did not score in time


class StepAssembler:
    """Walks tickets in order from `next_ticket`, keeping groups that pass `accept`
    (DAPO's dynamic filter; all pass by default) until it has B of them. Rank 0 tells
    `on_reject` how many groups were dropped as soon as they arrive, so the gate can
    admit replacements without waiting for the walk to reach them."""

    def __init__(self, feeder: ShardFeeder, batch_groups: int, distributed: bool,
                 accept: Callable[[Group], bool] | None = None, next_ticket: int = 0,
                 on_reject: Callable[[int], None] | None = None):
        self.feeder = feeder
        self.batch_groups = batch_groups
        self.distributed = distributed
        self.accept = accept or (lambda g: True)
        self.on_reject = on_reject
        self.cursor = next_ticket  # every ticket below it is trained or rejected
        self.buffer: dict[int, Group] = {}
        self._verdicts: dict[int, bool] = {}
        self._reported: set[int] = set()

    def _gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def next_step(self, step: int, poll_s: float = 0.02) -> StepBatch:
        t0 = time.perf_counter()
        while True:
            fresh = {}
            for g in self.feeder.poll(0.0 if self.feeder.exhausted else poll_s):
                if g.ticket < self.cursor or g.ticket in self.buffer:
                    raise RuntimeError(f"ticket {g.ticket} delivered twice")
                self.buffer[g.ticket] = g
                fresh[g.ticket] = (self.accept(g), g.pos, is_abandoned(g), teacher_dropped(g))
            views = self._gather((fresh, self.feeder.exhausted))
            for part, _ in views:
                self._verdicts.update(part)
            newly = [t for part, _ in views for t, (ok, *_) in part.items() if not ok]
            if newly and self.on_reject is not None:
                self.on_reject(len(newly))
            take, drop, t = [], [], self.cursor
            while t in self._verdicts and len(take) < self.batch_groups:
                (take if self._verdicts[t][0] else drop).append(t)
                t += 1
            if len(take) == self.batch_groups:
                break
            if all(done for _, done in views):
                raise RuntimeError(
                    f"the pipeline ended with step {step} incomplete ({len(take)}/"
                    f"{self.batch_groups} groups; {len(drop)} dropped by the dynamic filter or "
                    "rejected by the rollout workflow"
                    + ("; raise algo.dynamic_filter.prompt_factor)" if drop else ")"))
        self.cursor = t
        dropped = [self._verdicts.pop(d) for d in drop]
        rejected = [v[1] for v in dropped]
        for d in drop:
            self.buffer.pop(d, None)
        for k in take:
            self._verdicts.pop(k)
        mine = [self.buffer.pop(k) for k in take if k in self.buffer]
        if self.distributed:
            mine = [g for part in self._gather(mine) for g in part]
        return StepBatch(sorted(mine, key=lambda g: g.ticket), rejected, time.perf_counter() - t0,
                         sum(v[2] for v in dropped), sum(v[3] for v in dropped))
