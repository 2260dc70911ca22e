"""The driver actor: owner of the policy version, the staleness gate and weight pushes.

Everything that must agree on "which version is live" goes through this one async
actor, so no two parts can disagree:

* the rollout stage asks `acquire()` before starting a prompt group and gets a ticket
  (it waits while the StalenessGate is full) and calls `finish()` when the group is
  generated; the trainer reports groups its dynamic filter drops (`reject()`);
* rollout replicas `register_replica()` when they start (and load the latest weights
  before serving), then long-poll `wait_for_weights()` and `ack()` each version they
  loaded: pushes are pulled, so a replica that starts mid-run catches up by itself;
* trainer rank 0 calls `push_weights(version, [ref])` after each optimizer step; it
  returns once every registered replica has loaded the version (replicas that miss
  `push_timeout_s` are dropped), and only then does the gate's version advance.
  Publishing the version only after all replicas serve it is what makes the
  staleness bound exact: every token generated after admission at version v carries
  a version >= v.

Trainer (re)starts. Ray Train builds a fresh Ray Data pipeline each time it starts
the worker group (first start, or a restart after a worker failure); building it
calls `begin_generation()`, which pauses admissions and makes every call from an
older pipeline a no-op. Trainer rank 0 then calls `restore()` with its starting
point (version 0, or a checkpoint's version, next ticket, rejected count and the
prompt positions already consumed): the gate is reset to it, the checkpoint's
weights are published if the replicas serve anything else (a rollback after a
failure), and admissions resume. Weight publications carry a serial number, so a
rollback to an older version is still a new publication that every replica loads.

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
        # (serial, version, [weights ref]); serial 0 = the model on disk at version 0
        self._latest: tuple[int, int, list | None] = (0, 0, None)
        self._replicas: dict[str, int] = {}  # replica id -> serial it has loaded
        self._events: list[dict] = []  # step records and restore events, in order
        self._generation = 0
        self._paused = False
        self._consumed: set[int] = set()  # prompt positions trained or rejected

    def _c(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    # ------------------------------------------------------------ staleness gate
    async def acquire(self, position: int = -1, generation: int = 0) -> tuple[int, int] | None:
        """Wait for a slot; returns (ticket, version), or None when this prompt must be
        skipped: the run is closed, the caller's pipeline is an old one, or the prompt
        at `position` was already consumed before the checkpoint the run resumed from."""
        async with self._c():
            while True:
                if (self.gate.state.closed or generation != self._generation
                        or position in self._consumed):
                    return None
                if not self._paused:
                    ticket = self.gate.try_acquire()
                    if ticket is not None:
                        return ticket, self.gate.state.version
                await self._c().wait()

    async def finish(self, generation: int = 0) -> None:
        async with self._c():
            if generation == self._generation:
                self.gate.finish()
                self._c().notify_all()

    async def reject(self, n: int) -> None:
        """The trainer's dynamic filter dropped n delivered groups."""
        async with self._c():
            self.gate.reject(n)
            self._c().notify_all()

    async def begin_generation(self) -> int:
        """A new pipeline is being built: pause admissions until `restore()`."""
        async with self._c():
            self._generation += 1
            self._paused = True
            self.gate.state.running = 0  # the old pipeline's groups are abandoned
            self._c().notify_all()
            return self._generation

    def published_version(self) -> int:
        return self._latest[1]

    async def restore(self, version: int, next_ticket: int = 0, rejected: int = 0,
                      consumed: list[int] | None = None, weights: list | None = None) -> dict:
        """The trainer's starting point; publishes `weights` (when given) as `version`
        and resumes admissions once every replica serves them."""
        async with self._c():
            self.gate.restore(version, next_ticket, rejected)
            self._consumed = set(consumed or [])
            self._events.append({"event": "restore", "version": version})
        push = await self._publish(version, weights) if weights is not None else None
        async with self._c():
            self._paused = False
            self._c().notify_all()
        return {"version": version, "published": push is not None}

    async def close(self) -> None:
        """End of training: admit nothing more; take ownership of the last weights."""
        async with self._c():
            self.gate.close()
            self._c().notify_all()
        serial, version, weights = self._latest
        if weights is not None:
            self._latest = (serial, version, [ray.put(await weights[0])])

    def gate_state(self) -> dict:
        return {**self.gate.state_dict(), "eta": self.gate.eta,
                "batch_groups": self.gate.batch_groups,
                "max_concurrent": self.gate.max_concurrent}

    def version(self) -> int:
        return self.gate.state.version

    # ------------------------------------------------------------ weight sync
    async def register_replica(self, replica_id: str) -> tuple[int, int, list | None]:
        async with self._c():
            self._replicas[replica_id] = -1
            return self._latest

    async def unregister_replica(self, replica_id: str) -> None:
        async with self._c():
            self._replicas.pop(replica_id, None)
            self._c().notify_all()

    async def wait_for_weights(self, replica_id: str, have: int,
                               timeout_s: float = 30.0) -> tuple[int, int, list | None] | None:
        """Long poll: the latest (serial, version, [ref]) once its serial is past `have`."""
        async with self._c():
            if replica_id not in self._replicas:
                self._replicas[replica_id] = have  # dropped earlier: rejoin
            try:
                await asyncio.wait_for(self._c().wait_for(lambda: self._latest[0] > have), timeout_s)
            except asyncio.TimeoutError:
                return None
            return self._latest

    async def ack(self, replica_id: str, serial: int) -> None:
        async with self._c():
            self._replicas[replica_id] = serial
            self._c().notify_all()

    async def push_weights(self, version: int, weights: list) -> dict:
        """Publish `weights` as `version`; return when every live replica serves it."""
        if version <= self._latest[1]:
            raise ValueError(f"push of version {version} after version {self._latest[1]}")
        return await self._publish(version, weights)

    async def _publish(self, version: int, weights: list) -> dict:
        t0 = time.perf_counter()
        async with self._c():
            serial = self._latest[0] + 1
            self._latest = (serial, version, weights)
            self._c().notify_all()
            done = lambda: all(v >= serial for v in self._replicas.values())  # noqa: E731
            try:
                await asyncio.wait_for(self._c().wait_for(done), self.push_timeout_s)
                dropped = []
            except asyncio.TimeoutError:
                dropped = [r for r, v in self._replicas.items() if v < serial]
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
        self._events.append(record)

    def steps(self, since: int = 0) -> list[dict]:
        """Events from index `since` on (the job process tails these): step records,
        and `{"event": "restore", "version": v}` when the trainer (re)starts from v."""
        return self._events[since:]

    def latest_weights(self) -> tuple[int, list | None]:
        return self._latest[1], self._latest[2]
