"""The driver actor: owner of the policy version, the staleness gate and weight pushes.

Everything that must agree on "which version is live" goes through this one async
actor, so no two parts can disagree:

* the rollout stage asks `acquire()` before starting a prompt group and gets a ticket
  (it waits while the StalenessGate is full) and calls `finish()` when the group is
  generated;
* rollout replicas `register_replica()` when they start (and load the latest weights
  before serving), then long-poll `wait_for_weights()` and `ack()` each version they
  loaded: pushes are pulled, so a replica that starts mid-run catches up by itself;
* trainer rank 0 calls `push_weights(version, [ref])` after each optimizer step; it
  returns once every registered replica has loaded the version (replicas that miss
  `push_timeout_s` are dropped), and only then does the gate's version advance.
  Publishing the version only after all replicas serve it is what makes the
  staleness bound exact: every token generated after admission at version v carries
  a version >= v.

Weights travel through the object store: trainer rank 0 puts them once and every
replica reads that object. Its owner is the trainer process, so when the trainer
finishes (`close()`), the driver copies the last version into an object it owns,
which keeps the final weights readable by late replicas and by the job.
"""

from __future__ import annotations

import asyncio
import time

import ray

from areal_ray.data.staleness import StalenessGate


@ray.remote(num_cpus=0, max_concurrency=1000)
class Driver:
    def __init__(self, eta: int, batch_groups: int, max_concurrent: int = 0,
                 push_timeout_s: float = 120.0):
        self.gate = StalenessGate(eta, batch_groups, max_concurrent or None)
        self.push_timeout_s = push_timeout_s
        self._cond: asyncio.Condition | None = None
        self._latest: tuple[int, list | None] = (0, None)  # (version, [weights ref])
        self._replicas: dict[str, int] = {}  # replica id -> version it has loaded
        self._steps: list[dict] = []

    def _c(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    # ------------------------------------------------------------ staleness gate
    async def acquire(self) -> tuple[int, int] | None:
        """Wait for a slot; returns (ticket, version) or None once the run is closed."""
        async with self._c():
            while True:
                if self.gate.state.closed:
                    return None
                ticket = self.gate.try_acquire()
                if ticket is not None:
                    return ticket, self.gate.state.version
                await self._c().wait()

    async def finish(self) -> None:
        async with self._c():
            self.gate.finish()
            self._c().notify_all()

    async def close(self) -> None:
        """End of training: admit nothing more; take ownership of the last weights."""
        async with self._c():
            self.gate.close()
            self._c().notify_all()
        version, weights = self._latest
        if weights is not None:
            self._latest = (version, [ray.put(await weights[0])])

    def gate_state(self) -> dict:
        return {**self.gate.state_dict(), "eta": self.gate.eta,
                "batch_groups": self.gate.batch_groups,
                "max_concurrent": self.gate.max_concurrent}

    def version(self) -> int:
        return self.gate.state.version

    # ------------------------------------------------------------ weight sync
    async def register_replica(self, replica_id: str) -> tuple[int, list | None]:
        async with self._c():
            self._replicas[replica_id] = -1
            return self._latest

    async def unregister_replica(self, replica_id: str) -> None:
        async with self._c():
            self._replicas.pop(replica_id, None)
            self._c().notify_all()

    async def wait_for_weights(self, replica_id: str, have: int,
                               timeout_s: float = 30.0) -> tuple[int, list | None] | None:
        """Long poll: returns the latest (version, [ref]) once it is newer than `have`."""
        async with self._c():
            if replica_id not in self._replicas:
                self._replicas[replica_id] = have  # dropped earlier: rejoin
            try:
                await asyncio.wait_for(self._c().wait_for(lambda: self._latest[0] > have), timeout_s)
            except asyncio.TimeoutError:
                return None
            return self._latest

    async def ack(self, replica_id: str, version: int) -> None:
        async with self._c():
            self._replicas[replica_id] = version
            self._c().notify_all()

    async def push_weights(self, version: int, weights: list) -> dict:
        """Publish `weights` as `version`; return when every live replica serves it."""
        t0 = time.perf_counter()
        async with self._c():
            if version <= self._latest[0]:
                raise ValueError(f"push of version {version} after version {self._latest[0]}")
            self._latest = (version, weights)
            self._c().notify_all()
            done = lambda: all(v >= version for v in self._replicas.values())  # noqa: E731
            try:
                await asyncio.wait_for(self._c().wait_for(done), self.push_timeout_s)
                dropped = []
            except asyncio.TimeoutError:
                dropped = [r for r, v in self._replicas.items() if v < version]
                for r in dropped:
                    self._replicas.pop(r)
            self.gate.set_version(version)
            self._c().notify_all()
        return {"version": version, "push_s": time.perf_counter() - t0,
                "replicas": len(self._replicas), "dropped": dropped}

    def replicas(self) -> dict[str, int]:
        return dict(self._replicas)

    # ------------------------------------------------------------ step records
    def record_step(self, record: dict) -> None:
        self._steps.append(record)

    def steps(self, since: int = 0) -> list[dict]:
        """Step records from index `since` on (the job process tails these)."""
        return self._steps[since:]

    def latest_weights(self) -> tuple[int, list | None]:
        return self._latest
