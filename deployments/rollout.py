"""The rollout Serve app: replicas wrapping an inference engine, autoscaled by Serve.

Each replica registers with the run's driver actor before it serves anything and
loads the latest pushed weights, so a replica added by autoscaling (or restarted)
never generates with stale weights. A background task then long-polls the driver for
new publications (a new version, or a rollback after a trainer restart): on each one
it aborts in-flight generation (the engine returns partial
outputs, which clients resubmit), loads the weights and acks the version.

Without a driver (`driver_name=""`) the app serves the model's weights from disk at
version 0, which is how evaluation of a checkpoint runs.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
import torch
from ray import serve

from areal_ray.rollout.engine import GenerationRequest
from areal_ray.rollout.hf_engine import HFEngine
from areal_ray.weights import WeightReceiver, digest, state_from

logger = logging.getLogger("ray.serve")

APP_NAME = "areal-rollout"
DEPLOYMENT_NAME = "Rollout"


@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=5, health_check_timeout_s=60)
class RolloutServer:
    async def __init__(self, model_path: str, driver_name: str = "", namespace: str = "",
                   max_batch_size: int = 64, dtype: str = "float32", torch_threads: int = 1,
                   weights_timeout_s: float = 60.0, weights_backend: str = "gloo"):
        torch.set_num_threads(torch_threads)
        self.engine = HFEngine(model_path, max_batch_size=max_batch_size, dtype=dtype)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.driver = ray.get_actor(driver_name, namespace=namespace) if driver_name else None
        self._watcher = None
        self.serial = 0  # the driver's publication this replica serves (0: from disk)
        self.failed_serial = 0
        self.receiver = WeightReceiver(self.replica_id, weights_timeout_s, weights_backend)
        if self.driver is not None:
            got = await self.driver.register_replica.remote(
                self.replica_id, ray.get_runtime_context().get_node_id())
            while not self.receiver.joins(got[2]):  # a broadcast already under way
                self.serial = got[0]
                got = await self.driver.wait_for_weights.remote(self.replica_id, got[0], 30.0) or got
            await self._load(*got)
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _load(self, serial: int, version: int, payload) -> None:
        t0 = time.perf_counter()
        if payload is None:
            self.engine.version = version
        else:
            if isinstance(payload, list):  # object store
                state_dict = state_from(await payload[0])
            else:  # collective or disk; received while generation goes on
                state_dict = await asyncio.to_thread(self.receiver.receive, payload)
            await self.engine.update_weights(state_dict, version)
        self.serial = serial
        await self.driver.ack.remote(self.replica_id, serial, time.perf_counter() - t0)

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
            except Exception:  # noqa: BLE001 - keep polling; health check reports a dead watcher
                logger.exception("weight watcher failed; retrying")
                await asyncio.sleep(1.0)

    async def generate(self, input_ids: list[int], max_new_tokens: int,
                       temperature: float = 1.0, ignore_eos: bool = False) -> dict:
        res = await self.engine.generate(GenerationRequest(
            list(input_ids), max_new_tokens, temperature, ignore_eos=ignore_eos))
        return {"output_ids": res.output_ids, "logprobs": res.logprobs,
                "versions": res.versions, "stop_reason": res.stop_reason}

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, "version": self.engine.get_version(),
                "serial": self.serial, **self.engine.load()}

    def weights_digest(self) -> dict:
        """Which exact weights this replica serves (sha256 of its state dict)."""
        return {"replica_id": self.replica_id, "version": self.engine.get_version(),
                "digest": digest(self.engine.model.state_dict())}

    async def check_health(self) -> None:
        if self._watcher is not None and self._watcher.done():
            raise RuntimeError("weight watcher stopped")

    async def __del__(self):
        if self.driver is not None:
            try:
                await self.driver.unregister_replica.remote(self.replica_id)
            except Exception:  # noqa: BLE001 - the driver may be gone at shutdown
                pass


def build_app(model_path: str, driver_name: str, namespace: str, *, min_replicas: int = 1,
              max_replicas: int = 1, max_ongoing_requests: int = 256, max_batch_size: int = 64,
              num_cpus: float = 1.0, dtype: str = "float32", torch_threads: int = 1,
              weights_timeout_s: float = 60.0, weights_backend: str = "gloo"):
    if min_replicas == max_replicas:
        scaling = {"num_replicas": min_replicas}
    else:
        scaling = {"autoscaling_config": {
            "min_replicas": min_replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": max(1, max_ongoing_requests // 2)}}
    return RolloutServer.options(
        max_ongoing_requests=max_ongoing_requests, ray_actor_options={"num_cpus": num_cpus},
        logging_config={"enable_access_log": False},
        **scaling,
    ).bind(model_path, driver_name, namespace, max_batch_size, dtype, torch_threads,
           weights_timeout_s, weights_backend)
