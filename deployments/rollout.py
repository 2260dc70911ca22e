"""The rollout Serve app: replicas wrapping an inference engine, autoscaled by Serve.

Each replica registers with the run's driver actor before it serves anything and
loads the latest pushed weights, so a replica added by autoscaling (or restarted)
never generates with stale weights. A background task then long-polls the driver for
new publications (a new version, or a rollback after a trainer restart) and loads
each one into the engine: with `rollout.interrupt` the engine aborts in-flight
generation (partial outputs go back to the clients, which resubmit them), otherwise
it lets running requests finish first. A LoRA adapter push with
`rollout.lora_push=finish` (vLLM) does neither: running requests finish under the
adapter they started with while new ones get the new one. With `rollout.rolling_update` a replica takes
the driver's load slot first, so replicas swap weights one at a time while the others
keep generating; every token still carries the version that produced it.

The driver never calls replicas: they pull. That is how it reaches every replica,
including ones Serve starts or restarts mid-run, without tracking Serve's replica set.
Requests are routed by least outstanding generation budget (areal_ray/rollout/router.py).

The driver actor is the job's owner record (areal_ray/cluster/ownership.py): it dies with
the job's process however that ends, and the watcher's long poll then fails. A replica
that finds the driver gone removes what the job owned (its app, this replica included,
and its files on every node: `cleanup.reap`), so a killed job holds no replicas, GPUs or
/dev/shm for longer than that takes.

Without a driver (`driver_name=""`) the app serves the model's weights from disk at
version 0, which is how evaluation of a checkpoint runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
import torch
from ray import serve
from ray.serve.config import RequestRouterConfig

from areal_ray.cluster.cleanup import owner_alive, reap, sweep_local_files
from areal_ray.cluster.ownership import tag_of_driver
from areal_ray.cluster.roles import NodeRequirement
from areal_ray.config import Config
from areal_ray.config.root import lora_push_mode
from areal_ray.observe.metrics import ReplicaMetrics
from areal_ray.rollout.engine_client import DRAIN_POLL_S
from areal_ray.rollout.engines.adapters import lora_slots
from areal_ray.rollout.engines.base import FINISH, EngineOptions, GenerationRequest
from areal_ray.rollout.engines.registry import build_engine
from areal_ray.rollout.router import LeastOutstandingTokensRouter
from areal_ray.task.tokenizer import load_tokenizer
from areal_ray.weights.adapter import Adapter
from areal_ray.weights.encoding import NCCL_ENV
from areal_ray.weights.probe import probe_enabled, probe_ids
from areal_ray.weights.receivers import WeightReceiver

logger = logging.getLogger("ray.serve")

APP_NAME = "areal-rollout"
DEPLOYMENT_NAME = "Rollout"
METRICS_PERIOD_S = 2.0


@dataclass
class ServerOptions:
    """What one replica needs from the run config (small and picklable). No defaults of
    its own: the config's are the only ones (`from_config(Config())`)."""
    backend: str
    batching: str
    max_batch_size: int
    dtype: str
    torch_threads: int
    interrupt: bool
    rolling_update: bool
    weights_timeout_s: float
    weights_backend: str
    engine_kwargs: dict | None
    release_memory: bool  # free the engine's GPU memory during trainer steps (one GPU)
    run_name: str  # the `run` tag of this replica's dashboard metrics
    lora_rank: int = 0  # model.lora.rank when adapters are pushed, else 0
    lora_push: str = "pause"  # rollout.lora_push: what an adapter push does to running requests
    lora_slots: int = 2  # adapters the engine holds at once (adapters.lora_slots)
    lora_targets: tuple[str, ...] = ()  # model.lora.target_modules
    probe: bool = False  # score the load probe after every push (weights/probe.py)

    @classmethod
    def from_config(cls, cfg) -> ServerOptions:
        r = cfg.rollout
        # run.deterministic: a row's numerics must not depend on what else runs (the hf
        # engine's one-cohort-per-request layout, docs/reproducibility.md)
        batching = "invariant" if cfg.run.deterministic and r.backend == "hf" else r.batching
        return cls(backend=r.backend, batching=batching, max_batch_size=r.max_batch_size,
                   dtype=r.dtype or cfg.model.dtype, torch_threads=r.torch_threads, interrupt=r.interrupt,
                   rolling_update=r.rolling_update, weights_timeout_s=cfg.weights.timeout_s,
                   weights_backend=cfg.weights.backend, engine_kwargs=dict(r.engine_kwargs),
                   release_memory=r.release_memory, run_name=cfg.run.name,
                   lora_rank=cfg.model.lora.rank if cfg.model.lora.enabled else 0,
                   lora_push=lora_push_mode(r),
                   lora_slots=lora_slots(cfg.algo.eta, lora_push_mode(r) == FINISH),
                   lora_targets=tuple(cfg.model.lora.target_modules),
                   probe=probe_enabled(cfg))


async def all_or_none(coros) -> list:
    """The results of `coros`, run concurrently; when one raises, the others are
    cancelled before the error goes to the caller, so an engine does not go on
    generating for a call that has already failed."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=5, health_check_timeout_s=60,
                  graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
class RolloutServer:
    async def __init__(self, model_path: str, driver_name: str = "", namespace: str = "",
                   opts: ServerOptions | None = None):
        opts = opts or ServerOptions.from_config(Config())
        self.driver_name, self.namespace = driver_name, namespace
        self.owner = tag_of_driver(driver_name) or ""  # the job's tag (ownership.Owned)
        self.orphaned = False  # the driver is gone and what the job owned was reaped
        if driver_name and not await asyncio.to_thread(owner_alive, driver_name, namespace):
            # Started (or restarted by Serve, after a failed start) when the job is gone:
            # no running replica may be left to notice, so this one reaps.
            await self._reap()
            raise RuntimeError(f"driver {driver_name} is gone: the job that owns this app ended")
        torch.set_num_threads(opts.torch_threads)
        if driver_name and opts.release_memory:  # size the engine between trainer steps
            late = await ray.get_actor(driver_name, namespace=namespace).replica_starting.remote(
                serve.get_replica_context().replica_id.unique_id,
                ray.get_runtime_context().current_actor)
            if late:
                logger.warning(late)
        self.engine = build_engine(opts.backend, model_path, EngineOptions(
            max_batch_size=opts.max_batch_size, dtype=opts.dtype, batching=opts.batching,
            threads=opts.torch_threads, engine_kwargs=dict(opts.engine_kwargs or {}),
            release_memory=opts.release_memory, owner=tag_of_driver(driver_name) or "",
            lora_rank=opts.lora_rank, lora_slots=opts.lora_slots,
            lora_targets=tuple(opts.lora_targets)))
        await self.engine.warmup()
        if opts.probe:  # scored after every load (weights/probe.py)
            self.engine.probe_ids = probe_ids(self.engine.limits.vocab_size)
        # The app owns the tokenizer, as inference servers do: clients (the rollout
        # stage) then need no transformers of their own (seconds and ~350 MB a process).
        self.tokenizer = load_tokenizer(model_path)
        self.update_mode = "abort" if opts.interrupt else "wait"
        # An adapter push may let running requests finish under their adapter instead
        self.adapter_mode = FINISH if opts.lora_push == FINISH else self.update_mode
        self.rolling = opts.rolling_update
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.driver = ray.get_actor(driver_name, namespace=namespace) if driver_name else None
        self._watcher = self._releaser = None
        self.released = False  # the engine's GPU memory is freed for a trainer step
        self._memory = asyncio.Lock()  # a release and a push's resume never interleave
        self.serial = 0  # the driver's publication this replica serves (0: from disk)
        self.failed_serial = 0
        self.updates: list[dict] = []  # when each load held the engine (rolling-update checks)
        self.receiver = WeightReceiver(self.replica_id, opts.weights_timeout_s, opts.weights_backend,
                                       host=self.engine.loads_from_host)
        self.metrics = ReplicaMetrics(opts.run_name, self.replica_id)
        self._sampler = asyncio.get_running_loop().create_task(self._sample_metrics())
        if self.driver is not None:
            ctx = ray.get_runtime_context()
            # What the model on disk computes here: the load probe measures this engine's
            # gap to the trainer where both hold the same weights (weights/probe.py).
            disk_probe = None
            if self.engine.probe_ids:
                disk_probe = (self.engine.probe_ids, await self.engine.score(self.engine.probe_ids))
            got = await self.driver.register_replica.remote(
                self.replica_id, ctx.get_node_id(), ctx.current_actor, disk_probe)
            while got[2] is not None and not got[2].admits(self.replica_id):  # a broadcast under way
                self.serial = got[0]
                got = await self.driver.wait_for_weights.remote(self.replica_id, got[0], 30.0) or got
            await self._load(*got)
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
            if opts.release_memory:
                self._releaser = asyncio.get_running_loop().create_task(self._watch_release())

    async def _load(self, serial: int, version: int, payload) -> None:
        t0 = time.perf_counter()
        if payload is None:  # nothing published yet: the engine serves the model on disk
            self.engine.version = version
        elif self._streams(payload):  # bucket by bucket into the engine (sglang, a broadcast)
            await self._swap(None, version, self.receiver.stream(payload))
        else:  # received while generation goes on; only the swap holds the engine
            await self._swap(await self.receiver.receive(payload), version)
        load_s = time.perf_counter() - t0
        # What the new weights compute, for the driver to check against the trainer's
        # (weights/probe.py): an ack alone cannot tell a load that applied nothing.
        probe = None
        if self.engine.probe_ids and payload is not None:
            ids = self.engine.probe_ids
            probe = (ids, await self.engine.score(ids))
            self.updates[-1]["probe_s"] = time.perf_counter() - t0 - load_s
        self.serial = serial
        await self.driver.ack.remote(self.replica_id, serial, load_s, probe)

    def _streams(self, payload) -> bool:
        """Stream a broadcast into the engine rather than hold a whole received copy of
        the model beside the engine's own (the GPU memory a replica has outside its
        engine's share is small). Not with rolling updates: every replica must receive
        a broadcast at once, and the load slot admits one. A stream that breaks midway
        leaves the weights half written: the gate stays closed and Serve replaces the
        replica, where a whole receive would have fallen back to the object store."""
        return (not self.rolling and self.receiver.streams(payload)
                and self.engine.streams_buckets)

    async def _swap(self, state_dict: dict | None, version: int, buckets=None) -> None:
        if self.rolling:
            await self.driver.acquire_load_slot.remote(self.replica_id)
        try:
            t0 = time.time()
            async with self._memory:  # the new weights go into an engine that has its memory
                if self.released:
                    await self.engine.resume_memory()
                    self.released = False
            if buckets is not None:
                update = self.engine.update_weights_from_buckets(buckets, version, self.update_mode)
            elif isinstance(state_dict, Adapter):  # model.lora: applied to the engine's base
                update = self.engine.update_adapter(state_dict, version, self.adapter_mode)
            else:
                update = self.engine.update_weights(state_dict, version, self.update_mode)
            info = await update
            self.updates = (self.updates + [{"version": version, "start": t0, "end": time.time(),
                                             **info}])[-16:]
        finally:
            if self.rolling:
                await self.driver.release_load_slot.remote(self.replica_id)

    async def _watch(self) -> None:
        while True:
            try:
                got = await self.driver.wait_for_weights.remote(
                    self.replica_id, max(self.serial, self.failed_serial), 30.0)
                if got is not None:
                    try:
                        await self._load(*got)
                    except Exception:
                        # A failed broadcast is not retried: the trainer publishes the
                        # same version through the object store next.
                        self.failed_serial = got[0]
                        raise
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayActorError:
                if not await asyncio.to_thread(owner_alive, self.driver_name, self.namespace):
                    await self._reap()
                    return
                logger.warning("driver %s unreachable; retrying", self.driver_name)
                await asyncio.sleep(1.0)
            except Exception:  # noqa: BLE001 - keep polling; health check reports a dead watcher
                logger.exception("weight watcher failed; retrying")
                await asyncio.sleep(1.0)

    async def _reap(self) -> None:
        """The job is gone: remove what it owned (`cleanup.reap`: every replica may run
        it, each once; all but the first find nothing left). In a thread: it waits on
        tasks on the other nodes, and the replica's loop must go on answering Serve."""
        self.orphaned = True
        if not self.owner:  # a driver not named by a job's tag owns nothing we can name
            return
        logger.warning("driver %s is gone: removing what job %s owned", self.driver_name,
                       self.owner)
        try:
            report = await asyncio.to_thread(reap, self.owner)
            for line in report.lines():
                logger.warning(line)
        except Exception:  # noqa: BLE001 - the next sweep (a job's start, jobs.cleanup) catches it
            logger.exception("could not remove what job %s owned", self.owner)

    async def _watch_release(self) -> None:
        """Free the engine's GPU memory at each release round the trainer opens
        (areal_ray/driver/release.py); the next push's `_swap` restores it."""
        seen = await self.driver.release_seen.remote()
        while True:
            try:
                epoch = await self.driver.wait_for_release.remote(self.replica_id, seen, 30.0)
                if epoch is None:
                    continue
                async with self._memory:
                    if not self.released:
                        await self.engine.release_memory()
                        self.released = True
                seen = epoch
                await self.driver.ack_release.remote(self.replica_id, epoch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep polling; the trainer's round times out
                logger.exception("memory release failed; retrying")
                await asyncio.sleep(1.0)

    async def _sample_metrics(self) -> None:
        while True:
            try:
                load = self.engine.load()
                self.metrics.sample(load)
                if self.driver is not None:  # fire and forget: the run's idle accounting
                    self.driver.report_load.remote(self.replica_id, {
                        "time": time.time(), "tokens": load.get("tokens", 0),
                        "busy_s": load.get("busy_s"), "running": load.get("running", 0),
                        "queued": load.get("queued", 0)})
            except Exception:  # noqa: BLE001 - metrics must never take the replica down
                logger.exception("metrics sample failed")
            await asyncio.sleep(METRICS_PERIOD_S)

    async def generate(self, request: GenerationRequest) -> dict:
        """One request, checked against the engine's limits before the engine sees it
        (areal_ray/rollout/engines/limits.py): a bad one is a ValueError for this caller only."""
        req = self.engine.limits.admit(request)
        return (await self.engine.generate(req)).to_dict()

    def encode(self, text: str) -> list[int]:
        """The prompt's token ids, as generation sees them (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        """Texts of finished outputs, special tokens skipped (what rewards read)."""
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    async def generate_batch(self, requests: list[GenerationRequest]) -> list[dict]:
        """Several requests in one call (e.g. the unfinished samples of one prompt group),
        for clients to whom each Serve call is costly: one call routes, and is counted
        against `max_ongoing_requests`, once. Ends when every request has ended. All are
        checked before any runs; a bad one fails the call, naming which."""
        reqs = self.engine.limits.admit_all(list(requests))
        return [r.to_dict() for r in await all_or_none(self.engine.generate(r) for r in reqs)]

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, "version": self.engine.get_version(),
                "serial": self.serial, "updates": self.updates, **self.engine.load()}

    async def weights_digest(self) -> dict:
        """Which exact weights this replica serves: `digest` is the sha256 of the state
        dict in checkpoint names (see the engine's `weights_digest` for what it covers)."""
        return {"replica_id": self.replica_id, "version": self.engine.get_version(),
                **await self.engine.weights_digest()}

    async def check_health(self) -> None:
        if self._watcher is not None and self._watcher.done() and not self.orphaned:
            raise RuntimeError("weight watcher stopped")
        # An engine whose weight load failed keeps its gate closed (its weights may be
        # half written): failing the health check has Serve replace the replica, and
        # the new one loads the latest weights when it registers.
        failure = self.engine.load_failure()
        if failure:
            raise RuntimeError(f"replica stopped serving: {failure}")
        await self.engine.check_health()  # e.g. vLLM's engine-core process died

    async def __del__(self):
        if self.driver is not None:
            try:
                await self.driver.unregister_replica.remote(self.replica_id)
            except Exception:  # noqa: BLE001 - the driver may be gone at shutdown
                pass
        self.engine.shutdown()  # vLLM: stop its engine-core processes now
        if self.orphaned and self.owner:
            # Once more, as the reaped app ends: a writer of the job that was still dying
            # at the reap (a trainer mid-push) may have made a file since. The shm path
            # has every writer on a replica's node, so this node is enough.
            try:
                await asyncio.to_thread(sweep_local_files, False, "", self.owner)
            except Exception:  # noqa: BLE001 - the next sweep (a job's start, jobs.cleanup) catches it
                logger.exception("could not remove what job %s owned", self.owner)


def build_app(cfg, model_path: str, driver_name: str = "", namespace: str = ""):
    """The rollout app for run config `cfg`: replica count or autoscaling range,
    per-replica request limit and resources, and the request router."""
    r = cfg.rollout
    if r.min_replicas == r.max_replicas:
        scaling = {"num_replicas": r.min_replicas}
    else:
        scaling = {"autoscaling_config": {
            "min_replicas": r.min_replicas, "max_replicas": r.max_replicas,
            "target_ongoing_requests": r.target_ongoing_requests
            or max(1, r.max_ongoing_requests // 2),
            "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s}}
    if r.router == "least_tokens":
        scaling["request_router_config"] = RequestRouterConfig(
            request_router_class=LeastOutstandingTokensRouter,
            request_router_kwargs={"run": cfg.run.name})
    # custom resources and a label selector pin replicas to a node type (cluster/roles.py)
    actor = {"num_cpus": r.num_cpus, "num_gpus": r.num_gpus, **NodeRequirement.of(r).actor_options()}
    if r.num_gpus > 0:  # the trainer's NCCL settings (areal_ray.weights.encoding.NCCL_ENV)
        actor["runtime_env"] = {"env_vars": dict(NCCL_ENV)}
    return RolloutServer.options(
        max_ongoing_requests=r.max_ongoing_requests,
        ray_actor_options=actor,
        logging_config={"enable_access_log": False},
        **scaling,
    ).bind(model_path, driver_name, namespace, ServerOptions.from_config(cfg))
