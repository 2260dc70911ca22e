"""The driver actor: the one place the run's versions, admissions and pushes agree.

Everything that must agree on "which version is live" goes through this one async
actor, so no two parts can disagree. It is thin on purpose: the rules live in pure
classes, each unit-tested without Ray, and the actor only serialises calls, waits on
one condition variable for what they answer, and wakes waiters after each change.

* `Admission` (admission.py): the staleness gate, pipeline generations, the restart
  state machine, consumed positions, the prompt reader's lead, and the job's hold on
  admissions while it starts (`release_admissions()`). The rollout stage
  calls `acquire()` before a prompt group (waiting while the gate is full) and
  `finish()` after; the trainer calls `reject()` for groups its filter drops.
* `Publication` (publication.py): serials, acks, the collective group's membership
  epochs and the rolling-update load slot. Replicas `register_replica()`, long-poll
  `wait_for_weights()` and `ack()` what they load (pushes are pulled, so a replica
  that starts mid-run catches up by itself); trainer rank 0 `push_weights()` (or
  `begin_push`/`end_push` on the collective path, `fallback_push` when a broadcast
  fails). A push returns once every live replica acked, and only then does the gate's
  version advance: that is what makes the staleness bound exact (every token generated
  after admission at version v carries a version >= v).
* `Fleet` (fleet.py): load reports and the liveness of replicas and reward actors.
* `EventLog` (events.py): step records and restore events, tailed by the job.

A trainer (re)start: Ray Train builds a fresh Ray Data pipeline, whose factory calls
`begin_generation()`; trainer rank 0 then calls `restore()` with its starting point,
which publishes the checkpoint's weights when the replicas serve others (a rollback)
and resumes admissions once they are served.

Object-store weights are put by trainer rank 0, which owns them; when training ends
(`close()`) the driver copies the last version into an object it owns, so the final
weights stay readable by late replicas and the job.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from areal_ray.data.staleness import StalenessGate
from areal_ray.driver.admission import WAIT, Admission
from areal_ray.driver.events import EventLog
from areal_ray.driver.fleet import Fleet
from areal_ray.driver.publication import Publication
from areal_ray.driver.release import MemoryRelease
from areal_ray.observe.metrics import DriverMetrics
from areal_ray.weights.payloads import AdapterMeta, AdapterPayload, CollectivePayload
from areal_ray.weights.probe import ProbeCheck, ProbeMismatch, ProbeRule

MONITOR_PERIOD_S = 2.0
logger = logging.getLogger(__name__)


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
                 push_timeout_s: float = 120.0, run_name: str = "", ordered: bool = False,
                 held: bool = False, probe: ProbeRule | None = None):
        """`held`: admit nothing until `release_admissions()`. `probe`: the rule every
        replica's load probe is judged by against the trainer's (weights/probe.py);
        None: no probe."""
        self.admission = Admission(StalenessGate(eta, batch_groups, max_concurrent or None),
                                   ordered=ordered, held=held)
        self.publication = Publication()
        self.fleet = Fleet()
        self.release = MemoryRelease()
        self.events = EventLog()
        self.metrics = DriverMetrics(run_name)
        self.push_timeout_s = push_timeout_s
        self.probe = ProbeCheck(probe) if probe is not None else None
        self._probe_failed: dict[int, str] = {}  # serial -> the first replica's mismatch
        self._stop_requested = False  # the job was interrupted (Ctrl-C): stop at a step's end
        self._cond: asyncio.Condition | None = None  # made on the actor's event loop
        self._monitor: asyncio.Task | None = None

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _until(self, answer):
        """Call `answer()` (under the lock) until it is not WAIT; return what it gave."""
        while (got := answer()) is WAIT:
            await self.cond.wait()
        return got

    # ------------------------------------------------------------ admission
    async def acquire(self, position: int = -1, generation: int = 0) -> tuple[int, int] | None:
        """(ticket, version) once the gate admits the prompt group at `position`; None
        when it must be skipped (closed run, old pipeline, consumed before the resume)."""
        async with self.cond:
            if self.admission.arrive(generation):
                self.cond.notify_all()  # a paused reader may go on
            got = await self._until(lambda: self.admission.decide(position, generation))
            if got is not None and self.admission.ordered:
                self.cond.notify_all()  # the next position may be waiting for this one
            return None if got is None else (got.ticket, got.version)

    async def finish(self, generation: int = 0) -> None:
        async with self.cond:
            if self.admission.finish(generation):
                self.cond.notify_all()

    async def reject(self, n: int) -> None:
        """The trainer's dynamic filter dropped n delivered groups."""
        async with self.cond:
            self.admission.reject(n)
            self.cond.notify_all()

    async def release_admissions(self) -> None:
        """The job's start-up is done (the initial weights were evaluated): admit."""
        async with self.cond:
            if self.admission.release():
                self.cond.notify_all()

    async def begin_generation(self) -> int:
        """A new pipeline is being built: admissions wait for `restore()`."""
        async with self.cond:
            generation = self.admission.begin_generation()
            self.cond.notify_all()
            return generation

    async def restore(self, version: int, next_ticket: int = 0, rejected: int = 0,
                      consumed: list[int] | None = None, weights=None,
                      records: list[dict] = ()) -> dict:
        """The trainer's starting point; publishes `weights` (when given) as `version`
        and resumes admissions once every replica serves them. `records`: the step
        records its checkpoint kept (the job logs those it never read)."""
        async with self.cond:
            self.admission.restore(version, next_ticket, rejected, consumed or ())
            self.events.append({"event": "restore", "version": version, "records": list(records)})
        push = await self._publish(version, weights) if weights is not None else None
        async with self.cond:
            self.admission.resume()
            self.cond.notify_all()
        return {"version": version, "published": push is not None}

    async def read_ahead(self, generation: int, n: int, limit: int) -> None:
        """The prompt stream read `n` more prompts: returns once the rollout stage has
        taken all but `limit` of those read (areal_ray/data/stream.py)."""
        async with self.cond:
            if self.admission.read(generation, n):
                await self._until(lambda: WAIT if self.admission.reader_waits(generation, limit)
                                  else None)

    async def consumed_between(self, lo: int, hi: int) -> list[int]:
        """Consumed prompt positions in [lo, hi), once the trainer has restored."""
        async with self.cond:
            return await self._until(lambda: self.admission.consumed_between(lo, hi))

    def read_state(self) -> dict:
        s = self.admission.state()
        return {k: s[k] for k in ("read", "taken", "ahead")}

    def gate_state(self) -> dict:
        return self.admission.state()

    async def close(self, final=None) -> None:
        """End of training: admit nothing more; own the last weights (the trainer's
        objects die with it). After a collective, shm or disk push the trainer passes
        them as `final` (an object-store payload): they are published once more as the
        same version, so a replica starting later, and the job's final model, can read
        them."""
        async with self.cond:
            self.admission.close()
            self.cond.notify_all()
        latest = self.publication.latest
        if final is not None:
            owned = await final.reown()
            async with self.cond:
                self.publication.announce(latest.version, owned)
                self.cond.notify_all()
        elif latest.payload is not None:
            self.publication.swap_payload(await latest.payload.reown())

    def version(self) -> int:
        """The version the replicas were last told to serve."""
        return self.publication.latest.version

    # ------------------------------------------------------------ publication
    async def register_replica(self, replica_id: str, node_id: str = "", handle=None,
                               probe: tuple[list[int], list[float]] | None = None) -> tuple:
        """A new replica gets the latest publication (serial, version, payload). With
        its actor `handle` the monitor notices when it dies, so no push waits
        `push_timeout_s` for a replica that is gone. `probe`: its probe of the model on
        disk, which the load probe's moved rule measures its gap from (weights/probe.py)."""
        async with self.cond:
            if self.probe is not None:
                self.probe.register(replica_id, probe)
            latest = self.publication.register(replica_id, node_id)
            self.release.join(replica_id)
            if handle is not None:
                self.fleet.watch_replica(replica_id, handle)
            self._start_monitor()
            return latest.as_tuple()

    async def unregister_replica(self, replica_id: str) -> None:
        async with self.cond:
            self.publication.unregister(replica_id)
            self.fleet.forget_replica(replica_id)
            if self.probe is not None:
                self.probe.forget(replica_id)
            self.release.forget(replica_id)
            self.cond.notify_all()

    async def wait_for_weights(self, replica_id: str, have: int, timeout_s: float = 30.0):
        """Long poll: the latest (serial, version, payload) once its serial is past `have`."""
        async with self.cond:
            self.publication.rejoin(replica_id, have)
            try:
                await asyncio.wait_for(
                    self.cond.wait_for(lambda: self.publication.newer_than(have)), timeout_s)
            except TimeoutError:
                return None
            return self.publication.latest.as_tuple()

    async def ack(self, replica_id: str, serial: int, load_s: float = 0.0,
                  probe: tuple[list[int], list[float]] | None = None) -> None:
        """`probe`: the replica's probe of what it serves now (`InferenceEngine.score`)."""
        async with self.cond:
            latest = self.publication.latest
            if self.probe is not None and serial == latest.serial and latest.payload is not None:
                try:
                    self.probe.check(replica_id, latest.version, probe)
                except ProbeMismatch as e:  # the push fails (_await_loads), naming the replica
                    self._probe_failed.setdefault(serial, str(e))
            self.publication.ack(replica_id, serial, load_s)
            self.cond.notify_all()

    async def probe_baseline(self, ids: list[int], logprobs: list[float]) -> None:
        """Trainer rank 0, at the start of a fresh run: its probe of the model on disk,
        which every replica also serves then (weights/probe.py: the moved rule's anchor)."""
        if self.probe is not None:
            self.probe.baseline(ids, logprobs)

    async def expect_probe(self, version: int, ids: list[int], logprobs: list[float]) -> None:
        """Trainer rank 0, before it publishes `version`: the probe logprobs every replica
        must reproduce after loading it."""
        if self.probe is not None:
            self.probe.expect(version, ids, logprobs)

    async def push_weights(self, version: int, payload) -> dict:
        """Publish `payload` as `version`; return when every live replica serves it."""
        if version <= self.publication.latest.version:
            raise ValueError(f"push of version {version} after version "
                             f"{self.publication.latest.version}")
        return await self._publish(version, payload)

    def set_weight_store(self, host: str, port: int) -> None:
        """Trainer rank 0 serves the rendezvous store of the collective path."""
        self.publication.set_store(host, port)

    async def begin_push(self, version: int, specs: list, bucket_bytes: int,
                         adapter: AdapterMeta | None = None) -> dict | None:
        """Collective path, phase 1: announce a broadcast from trainer rank 0 to every
        registered replica; with `adapter` (model.lora) the broadcast carries that
        adapter's tensors, and the publication says so. None when no group can be formed
        (no store or replica)."""
        async with self.cond:
            group = self.publication.group_for_push()
            if group is None:
                return None
            epoch, ranks, world = group
            self.release.close_round()
            payload = CollectivePayload(
                epoch=epoch, store=self.publication.store, ranks=ranks, world=world,
                specs=tuple(specs), bucket_bytes=bucket_bytes)
            latest = self.publication.announce(
                version, payload if adapter is None else AdapterPayload(payload, adapter))
            self.cond.notify_all()
        return {"serial": latest.serial, "epoch": epoch, "world": world}

    async def end_push(self, version: int, serial: int) -> dict:
        """Collective path, phase 2: the sender is done; wait for the members' acks."""
        return await self._await_loads(version, serial, time.perf_counter())

    async def fallback_push(self, version: int, payload) -> dict:
        """The broadcast failed (a member died or timed out): publish `payload` (object
        store) instead; the next collective push forms a group of the live replicas."""
        self.publication.forget_group()
        return await self._publish(version, payload)

    async def _publish(self, version: int, payload) -> dict:
        t0 = time.perf_counter()
        async with self.cond:
            self.release.close_round()
            serial = self.publication.announce(version, payload).serial
            self.cond.notify_all()
        return await self._await_loads(version, serial, t0)

    async def _await_loads(self, version: int, serial: int, t0: float) -> dict:
        async with self.cond:
            try:
                await asyncio.wait_for(
                    self.cond.wait_for(lambda: self.publication.all_loaded(serial)),
                    self.push_timeout_s)
                dropped = []
            except TimeoutError:
                dropped = self.publication.drop_behind(serial)
            self.admission.served(version)
            self.cond.notify_all()
        if serial in self._probe_failed:
            raise ProbeMismatch(self._probe_failed.pop(serial))
        return {"version": version, "push_s": time.perf_counter() - t0,
                "replicas": len(self.publication.loaded), "dropped": dropped,
                "replicas_lost": self.fleet.replicas_lost,
                "load_s": self.publication.load_time(serial),
                **(self.probe.summary(version) if self.probe is not None else {})}

    async def acquire_load_slot(self, replica_id: str) -> None:
        """Rolling updates: one replica swaps weights at a time."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.publication.slot_free_for(replica_id))
            self.publication.take_slot(replica_id)

    async def release_load_slot(self, replica_id: str) -> None:
        async with self.cond:
            if self.publication.release_slot(replica_id):
                self.cond.notify_all()

    # ------------------------------------------------------------ memory release
    async def release_replicas(self, timeout_s: float) -> dict:
        """Trainer: every replica frees its engine's GPU memory before the step
        (release.py). Returns the replicas still pending after `timeout_s`, by what they
        are doing, for `release.unreleased` to fail the step; one found dead by then is
        dropped instead, as the monitor would a moment later."""
        t0 = time.perf_counter()
        async with self.cond:
            self.release.open_round()
            self.cond.notify_all()
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: not self.release.pending()),
                                       timeout_s)
            except TimeoutError:
                pass
            pending = self.release.pending()
        for replica_id in pending:
            handle = self.fleet.replicas.get(replica_id)
            if handle is not None and not await _alive(handle):
                self.fleet.lose_replica(replica_id)
                self._said_lost(replica_id)
                await self.unregister_replica(replica_id)
        async with self.cond:
            serial = self.publication.latest.serial
            served = [r for r, s in self.publication.loaded.items() if s >= serial]
            return {"release_s": time.perf_counter() - t0,
                    "release_pending": self.release.states(self.release.pending(), served)}

    def release_open(self) -> bool:
        """Whether a release round is open: a step under way, or one whose trainer failed,
        which leaves the replicas without memory until a publication (a restarted trainer
        makes one)."""
        return self.release.open

    async def replica_starting(self, replica_id: str, handle=None) -> str | None:
        """A replica about to build its engine, with `rollout.release_memory`: returns
        once no trainer step is under way (at most `release.start_wait_s`), after which
        every round waits for it; with its actor `handle` the monitor drops it if it
        dies first. Returns a warning when the wait ran out."""
        async with self.cond:
            bound = self.release.start_wait_s(self.push_timeout_s)
            try:
                await asyncio.wait_for(self.cond.wait_for(self.release.may_start), bound)
                late = None
            except TimeoutError:
                late = (f"release round {self.release.epoch} is still open after {bound:g} s: "
                        f"the engine sizes its memory beside a trainer step")
            self.release.start(replica_id)
            if handle is not None:
                self.fleet.watch_replica(replica_id, handle)
            self._start_monitor()
            return late

    async def wait_for_release(self, replica_id: str, seen: int, timeout_s: float = 30.0):
        """Replica long poll: the epoch of a release round newer than `seen`, or None."""
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: self.release.newer_than(seen)),
                                       timeout_s)
            except TimeoutError:
                return None
            return self.release.epoch

    def release_seen(self) -> int:
        """The release epoch a starting replica counts as seen (release.py)."""
        return self.release.first_seen()

    async def ack_release(self, replica_id: str, epoch: int) -> None:
        async with self.cond:
            self.release.ack(replica_id, epoch)
            self.cond.notify_all()

    def replicas(self) -> dict[str, int]:
        return dict(self.publication.loaded)

    def replica_nodes(self) -> set[str]:
        """Ray nodes of the registered replicas (`weights.path=auto` picks shared memory
        when they are all on the trainer's node)."""
        return self.publication.replica_nodes()

    def latest_weights(self) -> tuple[int, list | None]:
        """(version, [ref]) of the last object-store publication (None otherwise)."""
        latest = self.publication.latest
        return latest.version, None if latest.payload is None else latest.payload.object_refs

    # ------------------------------------------------------------ step records
    def record_step(self, record: dict) -> bool:
        """Keeps the step record; returns whether the trainer should stop after this step."""
        self.events.append(record)
        self.metrics.step(record)
        return self._stop_requested

    def request_stop(self) -> None:
        """The job was interrupted: the trainer checkpoints and stops after its step."""
        self._stop_requested = True

    def steps(self, since: int = 0) -> list[dict]:
        """Events from index `since` on (the job tails these: events.py)."""
        return self.events.read(since)

    # ------------------------------------------------------------ monitoring
    def report_load(self, replica_id: str, report: dict) -> None:
        """A replica's periodic engine report (fleet.py)."""
        self.fleet.report_load(replica_id, report)

    def replica_loads(self) -> dict[str, list[dict]]:
        return self.fleet.loads

    async def register_reward_actor(self, actor_id: str, handle) -> None:
        self.fleet.watch_reward_actor(actor_id, handle)
        self._start_monitor()

    def reward_actors(self) -> list[str]:
        return sorted(self.fleet.reward_actors)

    def _said_lost(self, replica_id: str) -> None:
        logger.warning("rollout replica %s is gone (%d lost so far): the run goes on with the "
                       "others", replica_id, self.fleet.replicas_lost)

    def _start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            for replica_id in await self.fleet.sweep(_alive):  # counted lost there
                self._said_lost(replica_id)
                await self.unregister_replica(replica_id)  # a pending push stops waiting
            self.metrics.replicas(len(self.publication.loaded))
            self.metrics.reward_actors(len(self.fleet.reward_actors))
            await asyncio.sleep(MONITOR_PERIOD_S)
