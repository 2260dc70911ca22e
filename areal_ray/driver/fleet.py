"""Fleet: the rollout replicas' load reports and which replicas and reward actors live.

Monitoring is apart from admission and publication because it is the one part of the
driver that polls: every few seconds it pings each watched actor, so a push stops
waiting for a replica that died (rather than for `push_timeout_s`), and the dashboard
shows live pool sizes (Ray Data scales the reward pool, and a stopped actor says
nothing). The ping is passed in (`alive`), so this class needs no Ray.

Load reports ({time, tokens, busy_s, running, queued} every few seconds per replica)
are what the run's rollout idle fraction is computed from (utilization.py). They are
kept per replica up to `max_reports`, then thinned (`utilization.thin`) so a long run's
driver stays flat in memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from areal_ray.observe.utilization import thin

MAX_LOAD_REPORTS = 2_000  # per replica; beyond it the reports are thinned


class Fleet:
    def __init__(self, max_reports: int = MAX_LOAD_REPORTS):
        self.max_reports = max_reports
        self.replicas: dict[str, object] = {}  # replica id -> actor handle
        self.reward_actors: dict[str, object] = {}  # actor id -> handle
        self.loads: dict[str, list[dict]] = {}  # replica id -> its load reports
        self.replicas_lost = 0  # found dead (not unregistered by themselves) so far

    def watch_replica(self, replica_id: str, handle) -> None:
        self.replicas[replica_id] = handle

    def forget_replica(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def lose_replica(self, replica_id: str) -> None:
        """A watched replica was found dead (with its node, or its process): counted."""
        if self.replicas.pop(replica_id, None) is not None:
            self.replicas_lost += 1

    def watch_reward_actor(self, actor_id: str, handle) -> None:
        self.reward_actors[actor_id] = handle

    def report_load(self, replica_id: str, report: dict) -> None:
        rows = self.loads.setdefault(replica_id, [])
        rows.append(report)
        if len(rows) > self.max_reports:
            rows[:] = thin(rows)

    async def sweep(self, alive: Callable[[object], Awaitable[bool]]) -> list[str]:
        """Ping every watched actor; forget the dead. Returns the replicas found dead
        (the driver unregisters them from the publication)."""
        dead = [r for r, h in list(self.replicas.items()) if not await alive(h)]
        for r in dead:
            self.lose_replica(r)
        for a, h in list(self.reward_actors.items()):
            if not await alive(h):
                self.reward_actors.pop(a, None)
        return dead
