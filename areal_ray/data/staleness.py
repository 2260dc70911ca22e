"""The staleness gate: which prompt group may start rolling out now (DESIGN invariant 2).

A group may start only while

    started < (version + eta + 1) * B      and      running < max_concurrent

where `started` counts groups ever admitted (running or delivered), B is the number
of groups per training step and `version` the policy version every rollout replica
already serves. Each admitted group gets a *ticket* (its admission index). The
trainer builds step t from exactly the tickets [t*B, (t+1)*B): a group with ticket g
was admitted at a version v_a with g < (v_a + eta + 1) * B, so it is trained at step
t = g // B <= v_a + eta, and since every token it has was generated at a version
>= v_a, its staleness t - min(versions) is at most eta. eta = 0 is the synchronous
baseline: step t's rollouts start only after version t is served.

Pure Python, no Ray: the driver actor wraps it with an asyncio condition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GateState:
    started: int = 0
    running: int = 0
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
        by_staleness = (s.version + self.eta + 1) * self.batch_groups - s.started
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
