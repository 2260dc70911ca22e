"""The rollout stage's admissions over a real staleness gate (no Ray): the gate's
tickets in order, and a rejected row's ticket going to the next row, even to one
already waiting at a full gate."""

import asyncio

import pytest

from areal_ray.data.staleness import StalenessGate
from areal_ray.data.tickets import Tickets


class AsyncGate:
    """The staleness gate as the driver serves it: `acquire` waits while it is full."""

    def __init__(self, eta: int, batch_groups: int, max_concurrent: int | None = None):
        self.gate = StalenessGate(eta, batch_groups, max_concurrent)
        self.cond = asyncio.Condition()
        self.asked: list[int] = []

    async def acquire(self, pos: int):
        self.asked.append(pos)
        async with self.cond:
            await self.cond.wait_for(lambda: self.gate.capacity() > 0 or self.gate.state.closed)
            if self.gate.state.closed:
                return None
            return self.gate.try_acquire(), self.gate.state.version

    async def finish(self):
        async with self.cond:
            self.gate.finish()
            self.cond.notify_all()

    async def close(self):
        async with self.cond:
            self.gate.close()
            self.cond.notify_all()


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def until(condition):
    while not condition():
        await asyncio.sleep(0.001)


def test_without_rejections_the_rows_get_the_gates_tickets_in_order():
    async def run():
        gate = AsyncGate(eta=1, batch_groups=2)
        tickets = Tickets(gate.acquire)
        got = [await tickets.admit(pos) for pos in range(4)]
        return got, gate.asked, tickets.spare

    got, asked, spare = asyncio.run(run())
    assert got == [(0, 0), (1, 0), (2, 0), (3, 0)] and asked == [0, 1, 2, 3] and spare == 0


def test_a_given_back_ticket_goes_to_the_next_row_whose_own_ticket_goes_on():
    async def run():
        gate = AsyncGate(eta=4, batch_groups=1)
        tickets = Tickets(gate.acquire)
        first = await tickets.admit(0)  # (0, 0): its row is rejected
        tickets.give_back(first)
        second = await tickets.admit(1)  # takes ticket 0; the gate's ticket 1 is banked
        await settle()
        third = await tickets.admit(2)
        await asyncio.wait_for(until(lambda: tickets.spare == 1), 5)
        return first, second, third, gate.asked, tickets.spare

    first, second, third, asked, spare = asyncio.run(run())
    assert first == second == (0, 0) and third == (1, 0)
    assert asked == [0, 1, 2]  # every row still asked the gate (read-ahead counts it)
    assert spare == 1  # ticket 2, for the next row


def test_a_row_waiting_at_a_full_gate_takes_a_given_back_ticket():
    """One slot: row 0 holds it, row 1 waits at the gate. Row 0 is rejected; row 1
    must not wait on (the gate only reopens when ticket 0 is delivered)."""
    async def run():
        gate = AsyncGate(eta=0, batch_groups=1, max_concurrent=1)
        tickets = Tickets(gate.acquire)
        held = await tickets.admit(0)
        waiting = asyncio.ensure_future(tickets.admit(1))
        await settle()
        assert not waiting.done()
        tickets.give_back(held)
        got = await asyncio.wait_for(waiting, 5)
        await gate.close()  # ends row 1's own request at the gate
        await settle()
        return held, got, tickets.spare

    held, got, spare = asyncio.run(run())
    assert got == held == (0, 0) and spare == 0


def test_a_cancelled_wait_loses_no_ticket():
    async def run():
        gate = AsyncGate(eta=4, batch_groups=1, max_concurrent=1)
        tickets = Tickets(gate.acquire)
        held = await tickets.admit(0)
        waiting = asyncio.ensure_future(tickets.admit(1))
        await settle()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        tickets.give_back(held)  # nobody waits now: kept for the next row
        await gate.finish()
        await asyncio.wait_for(until(lambda: tickets.spare == 2), 5)  # row 1's request is granted
        return tickets.spare, [await tickets.admit(p) for p in (2, 3)]

    spare, got = asyncio.run(run())
    assert spare == 2 and got == [(0, 0), (1, 0)]
