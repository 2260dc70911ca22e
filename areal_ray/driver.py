"""The driver actor: owner of the policy version, the staleness gate and weight pushes.

Everything that must agree on "which version is live" goes through this one async
actor, so no two parts can disagree:

* the rollout stage asks `acquire()` before starting a prompt group and gets a ticket
  (it waits while the StalenessGate is full) and calls `finish()` when the group is
  generated; the trainer reports groups its dynamic filter drops (`reject()`);
* rollout replicas `register_replica()` when they start (and load the latest weights
  before serving), then long-poll `wait_for_weights()` and `ack()` each version they
  loaded: pushes are pulled, so a replica that starts mid-run catches up by itself;
  with rolling updates a replica holds the load slot (`acquire_load_slot()`) while it
  swaps weights, so only one replica at a time stops generating;
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

How weights travel is `weights.path` (areal_ray/weights.py): a collective group
(`begin_push` announces the broadcast with the group's epoch and ranks, trainer
rank 0 sends, `end_push` waits for acks; a failed broadcast becomes
`fallback_push` through the object store), the object store, or a file on disk.
Replicas ack each publication with its load time. Object-store weights are put once
by trainer rank 0 and read by every replica; their owner is the trainer process, so
when the trainer finishes (`close()`), the driver copies the last version into an
object it owns, which keeps the final weights readable by late replicas and the job.
"""

from __future__ import annotations

import asyncio
import time

import ray

from areal_ray.data.read_ahead import ReadAhead
from areal_ray.data.staleness import StalenessGate
from areal_ray.metrics import DriverMetrics
from areal_ray.utilization import thin
from areal_ray.weight_payloads import CollectivePayload

MONITOR_PERIOD_S = 2.0
MAX_LOAD_REPORTS = 2_000  # per replica; beyond it the reports are thinned (utilization.thin)


async def _alive(handle) -> bool:
    """False only for an actor that is gone: a busy one answers late, and counts as alive."""
    try:
        await asyncio.wait_for(handle.__ray_ready__.remote(), 1.0)
    except TimeoutError:
        pass
    except ray.exceptions.RayActorError:
        return False
    return True


@ray.remote(num_cpus=0, max_concurrency=1000)
class Driver:
    def __init__(self, eta: int, batch_groups: int, max_concurrent: int = 0,
                 push_timeout_s: float = 120.0, run_name: str = ""):
        self.gate = StalenessGate(eta, batch_groups, max_concurrent or None)
        self.push_timeout_s = push_timeout_s
        self._cond: asyncio.Condition | None = None
        # (serial, version, [weights ref]); serial 0 = the model on disk at version 0
        self._latest: tuple[int, int, list | None] = (0, 0, None)
        self._replicas: dict[str, int] = {}  # replica id -> serial it has loaded
        self._events: list[dict] = []  # step records and restore events not yet read
        self._events_base = 0  # index (in the run's event order) of self._events[0]
        self._generation = 0
        self._read = ReadAhead()  # the prompt stream's lead over the rollout stage
        self._paused = False
        self._consumed: set[int] = set()  # prompt positions trained or rejected
        self._store: tuple[str, int] | None = None  # collective path: trainer rank 0's store
        self._members: list[str] | None = None  # replicas of the current group epoch
        self._epoch = 0
        self._load_s: dict[str, tuple[int, float]] = {}  # replica -> (serial, load seconds)
        self._nodes: dict[str, str] = {}  # replica -> Ray node id
        self._loader: str | None = None  # rolling updates: the replica swapping weights now
        self.metrics = DriverMetrics(run_name)
        self._reward_actors: dict[str, object] = {}  # actor id -> handle (pool-size metric)
        self._monitor: asyncio.Task | None = None
        self._loads: dict[str, list[dict]] = {}  # replica -> its engine load reports
        self._replica_handles: dict[str, object] = {}  # replica -> actor handle (liveness)
        self._stop_requested = False  # the job was interrupted (Ctrl-C): stop at a step's end

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
            if generation == self._generation and self._read.took(1):
                self._c().notify_all()  # a paused reader may go on
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
            self._read = ReadAhead()
            # Admissions wait for restore(), which resets the gate: the old pipeline's
            # running groups are abandoned.
            self._paused = True
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

    async def read_ahead(self, generation: int, n: int, limit: int) -> None:
        """The prompt stream read `n` more prompts: returns once the rollout stage has
        taken all but `limit` of those read, so a large dataset is read as it is used,
        not ahead into the object store (`areal_ray/data/stream.py`)."""
        async with self._c():
            if generation != self._generation:
                return
            self._read.read(n)
            while (not self.gate.state.closed and generation == self._generation
                   and self._read.ahead > limit):
                self._read.waiting = True
                await self._c().wait()

    def read_state(self) -> dict:
        return {"read": self._read.n_read, "taken": self._read.n_taken, "ahead": self._read.ahead}

    async def consumed_between(self, lo: int, hi: int) -> list[int]:
        """Consumed prompt positions in [lo, hi), once the trainer has restored its
        starting point: a read task of a resumed run leaves them out at the source."""
        async with self._c():
            while self._paused and not self.gate.state.closed:
                await self._c().wait()
            return sorted(p for p in self._consumed if lo <= p < hi)

    async def close(self, final: list | None = None) -> None:
        """End of training: admit nothing more; take ownership of the last weights (the
        trainer's objects die with it). After a collective or disk push the trainer
        passes them as `final`: they are published once more (same version) so that a
        replica starting later, and the job's final model, can read them."""
        async with self._c():
            self.gate.close()
            self._c().notify_all()
        serial, version, weights = self._latest
        if final is not None:
            owned = await final.reown()
            async with self._c():
                self._announce(version, owned)
        elif weights is not None:
            self._latest = (serial, version, await weights.reown())

    def gate_state(self) -> dict:
        return {**self.gate.state_dict(), "eta": self.gate.eta,
                "batch_groups": self.gate.batch_groups,
                "max_concurrent": self.gate.max_concurrent}

    def version(self) -> int:
        return self.gate.state.version

    # ------------------------------------------------------------ weight sync
    async def register_replica(self, replica_id: str, node_id: str = "",
                               handle=None) -> tuple[int, int, list | None]:
        """A new replica gets the latest publication. A collective one is a broadcast
        already under way without it: it must not hold up that push's acks, and it
        loads the next publication (every step pushes one; `close()` makes a last one).
        With its actor `handle` the monitor notices when the replica dies, so no push
        waits `push_timeout_s` for a replica that is gone."""
        async with self._c():
            serial, _, payload = self._latest
            joining_late = payload is not None and not payload.admits(replica_id)
            self._replicas[replica_id] = serial if joining_late else -1
            self._nodes[replica_id] = node_id
            if handle is not None:
                self._replica_handles[replica_id] = handle
            self._start_monitor()
            return self._latest

    async def unregister_replica(self, replica_id: str) -> None:
        async with self._c():
            self._replicas.pop(replica_id, None)
            self._replica_handles.pop(replica_id, None)
            self._c().notify_all()

    async def wait_for_weights(self, replica_id: str, have: int,
                               timeout_s: float = 30.0) -> tuple[int, int, list | None] | None:
        """Long poll: the latest (serial, version, [ref]) once its serial is past `have`."""
        async with self._c():
            if replica_id not in self._replicas:
                self._replicas[replica_id] = have  # dropped earlier: rejoin
            try:
                await asyncio.wait_for(self._c().wait_for(lambda: self._latest[0] > have), timeout_s)
            except TimeoutError:
                return None
            return self._latest

    async def ack(self, replica_id: str, serial: int, load_s: float = 0.0) -> None:
        async with self._c():
            self._replicas[replica_id] = serial
            self._load_s[replica_id] = (serial, load_s)
            self._c().notify_all()

    async def push_weights(self, version: int, weights) -> dict:
        """Publish `weights` (an object-store `[ref]` or a disk payload) as `version`;
        return when every live replica serves it."""
        if version <= self._latest[1]:
            raise ValueError(f"push of version {version} after version {self._latest[1]}")
        return await self._publish(version, weights)

    def set_weight_store(self, host: str, port: int) -> None:
        """Trainer rank 0 serves the rendezvous store of the collective path."""
        self._store, self._members = (host, port), None  # next push forms a new group

    async def begin_push(self, version: int, specs: list, bucket_bytes: int) -> dict | None:
        """Collective path, phase 1: announce a broadcast from trainer rank 0 (rank 0) to
        every registered replica; the group is re-formed (new epoch) when membership
        changed. None when no group can be formed (no store or no replica)."""
        async with self._c():
            if self._store is None or not self._replicas:
                return None
            members = sorted(self._replicas)
            if members != self._members:
                self._epoch, self._members = self._epoch + 1, members
            payload = CollectivePayload(self._epoch, self._store,
                                        {r: i + 1 for i, r in enumerate(members)},
                                        len(members) + 1, tuple(specs), bucket_bytes)
            serial = self._announce(version, payload)
        return {"serial": serial, "epoch": self._epoch, "world": len(members) + 1}

    async def end_push(self, version: int, serial: int) -> dict:
        """Collective path, phase 2: the sender is done; wait for the members' acks."""
        return await self._await_acks(version, serial, time.perf_counter())

    async def fallback_push(self, version: int, weights: list) -> dict:
        """The broadcast failed (a member died or timed out): publish through the object
        store instead; the next collective push forms a group of the live replicas."""
        self._members = None
        return await self._publish(version, weights)

    def _announce(self, version: int, payload) -> int:
        serial = self._latest[0] + 1
        self._latest = (serial, version, payload)
        self._c().notify_all()
        return serial

    async def _publish(self, version: int, payload) -> dict:
        t0 = time.perf_counter()
        async with self._c():
            serial = self._announce(version, payload)
        return await self._await_acks(version, serial, t0)

    async def _await_acks(self, version: int, serial: int, t0: float) -> dict:
        async with self._c():
            done = lambda: all(v >= serial for v in self._replicas.values())  # noqa: E731
            try:
                await asyncio.wait_for(self._c().wait_for(done), self.push_timeout_s)
                dropped = []
            except TimeoutError:
                dropped = [r for r, v in self._replicas.items() if v < serial]
                for r in dropped:
                    self._replicas.pop(r)
            self.gate.set_version(version)
            self._c().notify_all()
        loads = [t for (s, t) in self._load_s.values() if s == serial]
        return {"version": version, "push_s": time.perf_counter() - t0,
                "replicas": len(self._replicas), "dropped": dropped,
                "load_s": max(loads, default=0.0)}

    async def acquire_load_slot(self, replica_id: str) -> None:
        """Rolling updates: one replica swaps weights at a time. A holder that died or
        was dropped frees the slot (it is no longer registered)."""
        async with self._c():
            await self._c().wait_for(lambda: self._loader in (None, replica_id)
                                     or self._loader not in self._replicas)
            self._loader = replica_id

    async def release_load_slot(self, replica_id: str) -> None:
        async with self._c():
            if self._loader == replica_id:
                self._loader = None
                self._c().notify_all()

    def replicas(self) -> dict[str, int]:
        return dict(self._replicas)

    def replica_nodes(self) -> set[str]:
        """Ray nodes of the registered replicas (`weights.path=auto` picks shared memory
        when they are all on the trainer's node)."""
        return {self._nodes.get(r, "") for r in self._replicas}

    # ------------------------------------------------------------ step records
    def record_step(self, record: dict) -> bool:
        """Keeps the step record; returns whether the trainer should stop after this step."""
        self._events.append(record)
        self.metrics.step(record)
        return self._stop_requested

    def request_stop(self) -> None:
        """The job was interrupted: the trainer checkpoints and stops after its step."""
        self._stop_requested = True

    # ------------------------------------------------------------ monitoring
    def report_load(self, replica_id: str, report: dict) -> None:
        """A replica's periodic engine report {time, tokens, busy_s, running, queued}:
        the run's rollout idle fraction is computed from these (utilization.py)."""
        rows = self._loads.setdefault(replica_id, [])
        rows.append(report)
        if len(rows) > MAX_LOAD_REPORTS:
            rows[:] = thin(rows)

    def replica_loads(self) -> dict[str, list[dict]]:
        return self._loads

    async def register_reward_actor(self, actor_id: str, handle) -> None:
        """Reward actors announce themselves; the monitor counts the live ones (Ray Data
        scales the pool, and a stopped actor says nothing)."""
        self._reward_actors[actor_id] = handle
        self._start_monitor()

    def reward_actors(self) -> list[str]:
        return sorted(self._reward_actors)

    def _start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch_pools())

    async def _watch_pools(self) -> None:
        while True:
            for replica_id in [r for r, h in list(self._replica_handles.items()) if not await _alive(h)]:
                await self.unregister_replica(replica_id)  # a pending push stops waiting for it
            self.metrics.replicas(len(self._replicas))
            for actor_id, handle in list(self._reward_actors.items()):
                if not await _alive(handle):
                    self._reward_actors.pop(actor_id, None)
            self.metrics.reward_actors(len(self._reward_actors))
            await asyncio.sleep(MONITOR_PERIOD_S)

    def steps(self, since: int = 0) -> list[dict]:
        """Events from index `since` on (the job process tails these): step records,
        and `{"event": "restore", "version": v}` when the trainer (re)starts from v.
        Events before `since` were read (the job keeps them, and steps.jsonl), so the
        driver lets them go: its memory stays flat however long the run."""
        if since > self._events_base:
            del self._events[:since - self._events_base]
            self._events_base = since
        return self._events[max(0, since - self._events_base):]

    def latest_weights(self) -> tuple[int, list | None]:
        """(version, [ref]) of the last object-store publication (None otherwise)."""
        payload = self._latest[2]
        return self._latest[1], payload.object_refs if payload is not None else None
