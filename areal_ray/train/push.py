"""Trainer side of a weight push: gather the FSDP2 weights and publish a version.

Every trainer rank walks the parameters in the same order and all-gathers each one
(`DTensor.full_tensor()`, a collective among the trainer's ranks); only rank 0 uses
the result. On the collective path rank 0 streams the tensors straight into the
broadcast buckets of `areal_ray.weights.WeightGroup`, so gathering parameter k+1
overlaps the transfer of the previous bucket; on a GPU trainer they stay on the GPU
for NCCL. Rank 0 also keeps the full state dict on CPU: checkpoints use it, and it
is the object-store fallback when a broadcast fails (a replica died or timed out),
so a push always completes for the live replicas. Stats per push: path, bytes,
gather / transfer / load seconds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from areal_ray.config import WeightsConfig
from areal_ray.train.fsdp import full_state_dict
from areal_ray.weights import (
    SharedMemoryWeights,
    WeightGroup,
    free_port,
    manifest_of,
    put_state,
)


def iter_full(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per state-dict entry; a collective on every trainer rank."""
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t.detach()


def state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def push_stats(path: str, nbytes: int, transfer_s: float, push: dict) -> dict:
    """A step record's push fields; `push` is the driver's reply (acks, drops)."""
    return {"push_path": path, "push_bytes": nbytes, "push_transfer_s": transfer_s,
            "push_load_s": push["load_s"], "replicas": push["replicas"],
            "push_dropped": len(push["dropped"])}


class WeightPusher:
    def __init__(self, cfg: WeightsConfig, driver, rank: int, weights_dir: str):
        self.cfg, self.driver, self.rank = cfg, driver, rank
        self.weights_dir = Path(weights_dir)
        self.group: WeightGroup | None = None
        self.store = None
        self.shm: SharedMemoryWeights | None = None
        self.node_id = ray.get_runtime_context().get_node_id()
        if rank == 0 and cfg.path in ("collective", "auto"):
            port = free_port()
            self.store = WeightGroup.connect("0.0.0.0", port, cfg.timeout_s, is_master=True)
            ray.get(driver.set_weight_store.remote(ray.util.get_node_ip_address(), port))

    def choose_path(self) -> str:
        """Rank 0: `auto` is shm while every registered replica shares this node."""
        if self.cfg.path != "auto":
            return self.cfg.path
        nodes = ray.get(self.driver.replica_nodes.remote())
        return "shm" if nodes <= {self.node_id} else "collective"

    def push(self, model, version: int) -> tuple[dict, dict]:
        """All ranks: returns (full weights on rank 0 / {} elsewhere, stats on rank 0).
        Every rank must run the same gather, so rank 0's choice of path is broadcast."""
        t0 = time.perf_counter()
        path = self._agree(self.choose_path() if self.rank == 0 else "")
        if path != "collective":
            weights = full_state_dict(model)
            gather_s = time.perf_counter() - t0
            if self.rank != 0:
                return {}, {}
            stats = self._publish_simple(version, weights, path)
            stats.update(push_gather_s=gather_s, push_total_s=time.perf_counter() - t0)
            return weights, stats
        if self.rank != 0:
            for _ in iter_full(model):
                pass
            return {}, {}
        return self._push_collective(model, version, t0)

    @staticmethod
    def _agree(path: str) -> str:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return path
        box = [path]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Remove the shared-memory file (the driver keeps the final weights itself)."""
        if self.shm is not None:
            self.shm.unlink()

    def _publish_simple(self, version: int, weights: dict, path: str) -> dict:
        t0 = time.perf_counter()
        if path == "shm":
            if self.shm is None:
                self.shm = SharedMemoryWeights(uuid.uuid4().hex[:12])
            payload = self.shm.write(weights.values(), manifest_of(weights.items(), self.cfg.dtype))
        elif path == "disk":
            from safetensors.torch import save_file
            self.weights_dir.mkdir(parents=True, exist_ok=True)
            file = self.weights_dir / f"v{version}.safetensors"
            save_file({k: v.contiguous() for k, v in weights.items()}, str(file))
            payload = {"kind": "disk", "path": str(file)}
            (self.weights_dir / f"v{version - 2}.safetensors").unlink(missing_ok=True)
        else:
            payload = put_state(weights)
        stage_s = time.perf_counter() - t0
        push = ray.get(self.driver.push_weights.remote(version, payload))
        return push_stats(path, state_bytes(weights), stage_s, push)

    def _push_collective(self, model, version: int, t0: float) -> tuple[dict, dict]:
        # The manifest from global shapes, before anything is gathered; the transfer
        # dtype is applied by the sender as it fills each bucket.
        specs = manifest_of(model.state_dict().items(), self.cfg.dtype)
        weights: dict[str, torch.Tensor] = {}
        gather_s = [0.0]

        def stream():
            it = iter_full(model)
            while True:
                tg = time.perf_counter()
                item = next(it, None)
                if item is None:
                    return
                name, t = item
                weights[name] = t.cpu()  # checkpoints and the fallback want host copies
                gather_s[0] += time.perf_counter() - tg
                # As gathered: NCCL sends from the GPU it is on, gloo's bucket copy
                # brings it to the CPU (WeightGroup.send moves it to the group's device).
                yield t

        tensors = stream()
        plan = ray.get(self.driver.begin_push.remote(version, specs, self.cfg.bucket_mb << 20))
        if plan is None:  # no replica to send to: publish through the object store
            for _ in tensors:
                pass
            stats = self._publish_simple(version, weights, "object_store")
        else:
            try:
                if self.group is None or self.group.epoch != plan["epoch"]:
                    self.group = WeightGroup(self.store, plan["epoch"], 0, plan["world"],
                                             self.cfg.timeout_s, self.cfg.backend)
                sent = self.group.send(tensors, specs, self.cfg.bucket_mb << 20)
                push = ray.get(self.driver.end_push.remote(version, plan["serial"]))
                stats = push_stats("collective", sent["bytes"], sent["send_s"] - gather_s[0], push)
            except RuntimeError as e:  # a member died or timed out: no hang, fall back
                print(f"[areal-ray] collective push of v{version} failed ({str(e)[:120]}); "
                      "falling back to the object store", flush=True)
                self.group = None
                for _ in tensors:  # finish the gather: the other trainer ranks are in it
                    pass
                push = ray.get(self.driver.fallback_push.remote(version, put_state(weights)))
                stats = push_stats("object_store (fallback)", state_bytes(weights), 0.0, push)
        stats.update(push_gather_s=gather_s[0], push_total_s=time.perf_counter() - t0)
        return weights, stats
