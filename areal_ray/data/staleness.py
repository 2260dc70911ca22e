"""The staleness gate: which prompt group may start rolling out now (invariant 2 in
docs/architecture.md).

A group may start only while

    started - rejected < (version + eta + 1) * B      and      running < max_concurrent

where `started` counts groups ever admitted (running or delivered), `rejected` those
that the trainer's dynamic filter dropped (they do not count, as in AReaL), B is the
number of groups per training step and `version` the policy version every rollout
replica already serves. Each admitted group gets a *ticket* (its admission index).
The trainer takes groups in ticket order, skipping rejected ones, B accepted groups
per step. A group X admitted at version v_a saw fewer than (v_a + eta + 1) * B
non-rejected groups, and every group with a smaller ticket was among them (or is
rejected), so at most (v_a + eta + 1) * B - 1 accepted groups precede X: X is
trained at a step t <= v_a + eta. Every token of X was generated at a version >= v_a,
so its staleness t - min(versions) is at most eta. Without rejections step t is
exactly the tickets [t*B, (t+1)*B). eta = 0 is the synchronous baseline: step t's
rollouts start only after version t is served.

Resume: a checkpoint taken after step t records the next ticket and how many tickets
before it were rejected, so `started - rejected == (t+1) * B` and the bound continues
exactly (AReaL's fix #1345 sets accepted = version * B for the same reason).

Pure Python, no Ray: the driver actor wraps it with an asyncio condition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GateState:
    started: int = 0
    running: int = 0
    rejected: int = 0
    version: int = 0
    closed: bool = False


class StalenessGate:
    def __init__(self, eta: int, batch_groups: int, max_concurrent: int | None = None):
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        self.eta = eta
        self.batch_groups = batch_groups
        # Default concurrency: everything the staleness bound allows.
        self.max_concurrent = max_concurrent or (eta + 1) * batch_groups
        self.state = GateState()

    def capacity(self) -> int:
        s = self.state
        if s.closed:
            return 0
        by_staleness = (s.version + self.eta + 1) * self.batch_groups - (s.started - s.rejected)
        return max(0, min(by_staleness, self.max_concurrent - s.running))

    def try_acquire(self) -> int | None:
        """Admit one group; returns its ticket, or None if it must wait."""
        if self.capacity() <= 0:
            return None
        ticket = self.state.started
        self.state.started += 1
        self.state.running += 1
        return ticket

    def finish(self) -> None:
        """A running group finished (delivered, with or without reward)."""
        if self.state.running <= 0:
            raise RuntimeError("StalenessGate.finish called with no running group")
        self.state.running -= 1

    def reject(self, n: int = 1) -> None:
        """n delivered groups were dropped by the dynamic filter: their slots free up."""
        if n < 0 or self.state.rejected + n > self.state.started - self.state.running:
            raise RuntimeError(f"StalenessGate.reject({n}): only "
                               f"{self.state.started - self.state.running - self.state.rejected} "
                               "delivered groups can be rejected")
        self.state.rejected += n

    def restore(self, version: int, next_ticket: int, rejected: int) -> None:
        """Restart from a checkpoint: nothing runs, tickets continue at `next_ticket`."""
        accepted = next_ticket - rejected
        if accepted != version * self.batch_groups:
            raise ValueError(f"inconsistent resume state: {next_ticket} tickets - {rejected} "
                             f"rejected != version {version} x {self.batch_groups} groups")
        self.state = GateState(started=next_ticket, running=0, rejected=rejected, version=version)

    def set_version(self, version: int) -> None:
        if version < self.state.version:
            raise ValueError(f"version went backwards: {self.state.version} -> {version}")
        self.state.version = version

    def close(self) -> None:
        """No further admissions (end of run); running groups still finish."""
        self.state.closed = True

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, d: dict) -> None:
        self.state = GateState(**d)
