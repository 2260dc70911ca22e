"""The rollout stage's admissions: the staleness gate's tickets, and those a rejected
row gives back (pure asyncio, no Ray: the stage passes the driver's `acquire`).

The trainer takes tickets in order and waits for each, so every admitted ticket must
end up holding a group. When a workflow rejects its row (returns None), its ticket
goes to the next row that asks for one; it keeps its gate slot and its admitted
version, and the group it ends up with is generated later, at that version or a
newer one, so the staleness bound holds.

Every row still asks the driver (`acquire` counts the row as taken for the prompt
stream's read-ahead, and skips prompts consumed before a resume). A row waiting at
the gate takes a ticket given back meanwhile rather than waiting on: otherwise, with
every call waiting at a full gate, the given-back ticket (the one the trainer waits
for) would never be filled. The driver's answer to a row served that way is, when it
comes, a ticket for the next row.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import deque
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)
Admitted = tuple[int, int]  # (ticket, admitted version)


class Tickets:
    def __init__(self, acquire: Callable[[int], Awaitable[Admitted | None]]):
        """`acquire(position)`: the driver's gate; None when the row must be skipped."""
        self.acquire = acquire
        self._spare: list[Admitted] = []  # a heap: the oldest ticket goes first
        self._waiting: deque[asyncio.Future] = deque()
        self._banking: set[asyncio.Task] = set()

    @property
    def spare(self) -> int:
        return len(self._spare)

    async def admit(self, position: int) -> Admitted | None:
        """A ticket for the row at `position`: a given-back one if any, else the gate's."""
        asked = asyncio.ensure_future(self.acquire(position))
        if self._spare:
            self._bank(asked)
            return heapq.heappop(self._spare)
        handed = asyncio.get_running_loop().create_future()
        self._waiting.append(handed)
        try:
            await asyncio.wait({asked, handed}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: a ticket handed or granted meanwhile goes on
            if handed.done() and not handed.cancelled():
                self.give_back(handed.result())
            else:
                self._waiting.remove(handed)
            self._bank(asked)
            raise
        if handed.done() and not handed.cancelled():
            self._bank(asked)
            return handed.result()
        self._waiting.remove(handed)
        return asked.result()

    def give_back(self, admitted: Admitted) -> None:
        """A rejected row's ticket: to the first row still waiting, else kept spare."""
        while self._waiting:
            handed = self._waiting.popleft()
            if not handed.done():
                handed.set_result(admitted)
                return
        heapq.heappush(self._spare, admitted)

    def _bank(self, asked: asyncio.Future) -> None:
        """The gate's answer to a row that was served otherwise: a ticket to give on."""
        async def bank():
            try:
                admitted = await asked
            except Exception:  # noqa: BLE001 - the driver is gone: the run fails elsewhere
                logger.warning("a gate ticket for the next row was lost", exc_info=True)
                return
            if admitted is not None:
                self.give_back(tuple(admitted))
        task = asyncio.ensure_future(bank())
        self._banking.add(task)
        task.add_done_callback(self._banking.discard)
