"""The trainer's side of the weight paths: one sender per `weights.path`, built by
`sender_for`.

Every trainer rank takes part in gathering the FSDP2 weights (`DTensor.full_tensor()`
is a collective among the trainer's ranks); only rank 0 publishes. So a sender has
two halves: `push` on rank 0 (gather, publish, return the full weights and the push
stats) and `follow` on the other ranks (the same gather, results dropped).

* Staged paths (object store, disk, shm) gather the whole state dict onto the CPU,
  then publish it in one piece through `driver.push_weights`.
* The collective path streams the tensors straight into the broadcast buckets of
  `WeightGroup`, so gathering parameter k+1 overlaps the transfer of the previous
  bucket; on a GPU trainer they stay on the GPU for NCCL. Rank 0 also keeps a CPU
  copy of every tensor: checkpoints use it, and it is the object-store fallback when
  a broadcast fails (a replica died or timed out), so a push always completes for the
  live replicas.

Every path publishes in `weights.dtype` when it is set (bf16 replicas of an fp32
trainer get half the bytes, through the object store and onto /dev/shm alike); the
weights a push returns stay in the trained dtype, since checkpoints are written from
them.

With a LoRA adapter (`SenderContext.adapter`, from `model.lora`) every path gathers
and publishes only the adapter's tensors, wrapped in an `AdapterPayload` with its
meta; the weights a push returns are then the adapter's (checkpoints and the final
model merge them, areal_ray/train/lora.py). The collective path gathers the adapter
whole first (it is small, and its manifest is then the gathered tensors', not the
model's) and broadcasts it as it would the model; the driver wraps the broadcast's
payload (`Driver.begin_push`), and the object-store fallback is wrapped alike.

Stats per push (`push_stats`): path, bytes, gather / transfer / load seconds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from areal_ray.config import WeightsConfig
from areal_ray.train.fsdp import full_state_dict
from areal_ray.weights.encoding import SharedMemoryWeights, manifest_of, put_state
from areal_ray.weights.group import WeightGroup
from areal_ray.weights.payloads import AdapterMeta, AdapterPayload, DiskPayload, WeightPayload

# What `weights.path=auto` chooses between, per push (`WeightPusher.choose_path`).
AUTO_PATHS = ("shm", "collective")


def iter_full(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per state-dict entry; a collective on every trainer rank."""
    for name, t in model.state_dict().items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t.detach()


def as_dtype(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """`state` as the replicas get it: every tensor in `dtype` (empty: unchanged), as
    the collective path converts each bucket (`manifest_of`)."""
    if not dtype:
        return state
    to = getattr(torch, dtype)
    return {k: v.to(to) for k, v in state.items()}


def push_stats(path: str, nbytes: int, transfer_s: float, push: dict) -> dict:
    """A step record's push fields; `push` is the driver's reply (acks, drops)."""
    return {"push_path": path, "push_bytes": nbytes, "push_transfer_s": transfer_s,
            "push_load_s": push["load_s"], "replicas": push["replicas"],
            "push_dropped": len(push["dropped"]), "replicas_lost": push.get("replicas_lost", 0),
            **{k: push[k] for k in ("probe_max_diff", "probe_signal", "probe_moved", "probe_unseen")
               if k in push}}


@dataclass(frozen=True)
class SenderContext:
    """What senders are built from: the weights config, the run's driver actor, this
    trainer rank and where the disk path writes its files."""
    cfg: WeightsConfig
    driver: object  # the Driver actor's handle
    rank: int
    weights_dir: Path
    owner: str = ""  # the job's tag (ownership.Owned): names the shm files
    adapter: AdapterMeta | None = None  # model.lora: push the adapter, not the model

    def gather(self, model) -> dict[str, torch.Tensor]:
        """What a push sends, whole on the CPU (a collective on every trainer rank): the
        full state dict, or the LoRA adapter's tensors only."""
        if self.adapter is not None:
            from areal_ray.train.lora import adapter_state
            return adapter_state(model)
        return full_state_dict(model)

    def wrap(self, payload: WeightPayload) -> WeightPayload:
        """The path's payload as published: an adapter's says whose and how to apply it."""
        return payload if self.adapter is None else AdapterPayload(payload, self.adapter)

    def object_payload(self, weights: dict[str, torch.Tensor]) -> WeightPayload:
        """`weights` (what `gather` returned) in the object store, as published: the
        trainer's restore and its final weights go to the driver this way."""
        return self.wrap(put_state(weights))


class StagedSender:
    """A path that gathers the whole state dict first, then publishes one payload."""

    path = ""

    def __init__(self, ctx: SenderContext):
        self.ctx = ctx

    def stage(self, version: int, weights: dict[str, torch.Tensor]) -> WeightPayload:
        """Put the weights where replicas read them; the payload that says where."""
        raise NotImplementedError

    def follow(self, model) -> None:
        self.ctx.gather(model)

    def push(self, model, version: int, t0: float) -> tuple[dict, dict]:
        """Rank 0: (full weights, or the adapter, on CPU; push stats); `t0` is when the
        push began."""
        weights = self.ctx.gather(model)
        gather_s = time.perf_counter() - t0
        stats = self.publish(version, weights)
        stats.update(push_gather_s=gather_s, push_total_s=time.perf_counter() - t0)
        return weights, stats

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> dict:
        """Stage and publish gathered weights; returns once every replica serves them."""
        t0 = time.perf_counter()
        payload = self.ctx.wrap(self.stage(version, weights))
        stage_s = time.perf_counter() - t0
        push = ray.get(self.ctx.driver.push_weights.remote(version, payload))
        return push_stats(self.path, self.sent_bytes(weights), stage_s, push)

    def sent_bytes(self, weights: dict[str, torch.Tensor]) -> int:
        """Bytes the replicas get: in `weights.dtype` when it is set."""
        dtype = self.ctx.cfg.dtype
        size = getattr(torch, dtype).itemsize if dtype else None
        return sum(v.numel() * (size or v.element_size()) for v in weights.values())

    def close(self) -> None:
        pass


class ObjectStoreSender(StagedSender):
    path = "object_store"

    def stage(self, version: int, weights: dict[str, torch.Tensor]) -> WeightPayload:
        return put_state(as_dtype(weights, self.ctx.cfg.dtype))


class DiskSender(StagedSender):
    """`v<version>.safetensors` under the run's weights dir; the last two are kept (a
    replica may still be reading the previous one)."""

    path = "disk"

    def stage(self, version: int, weights: dict[str, torch.Tensor]) -> WeightPayload:
        from safetensors.torch import save_file
        folder = self.ctx.weights_dir
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / f"v{version}.safetensors"
        sent = as_dtype(weights, self.ctx.cfg.dtype)
        save_file({k: v.contiguous() for k, v in sent.items()}, str(file))
        (folder / f"v{version - 2}.safetensors").unlink(missing_ok=True)
        return DiskPayload(str(file))


class ShmSender(StagedSender):
    """Two shared-memory files rewritten in place, alternating (`SharedMemoryWeights`)."""

    path = "shm"

    def __init__(self, ctx: SenderContext):
        super().__init__(ctx)
        self.shm: SharedMemoryWeights | None = None

    def stage(self, version: int, weights: dict[str, torch.Tensor]) -> WeightPayload:
        if self.shm is None:
            if self.ctx.owner:
                # An earlier trainer incarnation of this job (a restart after a worker
                # failure) left its two files here; it cannot remove them itself.
                from areal_ray.cluster.cleanup import sweep_local_files
                sweep_local_files(dry_run=False, own_tag=self.ctx.owner)
            self.shm = SharedMemoryWeights(uuid.uuid4().hex[:12], owner=self.ctx.owner)
        return self.shm.write(weights.values(), manifest_of(weights.items(), self.ctx.cfg.dtype))

    def close(self) -> None:
        """Remove the shared-memory files (the driver keeps the final weights itself)."""
        if self.shm is not None:
            self.shm.unlink()


class CollectiveSender:
    """Broadcasts to the driver's group of the current epoch; falls back to the object
    store when there is no replica, or when the broadcast fails."""

    path = "collective"

    def __init__(self, ctx: SenderContext):
        self.ctx = ctx
        self.fallback = ObjectStoreSender(ctx)
        self.group: WeightGroup | None = None
        self.store = None

    def _serve_store(self) -> None:
        """Rank 0 serves the group's rendezvous store on the node's address (not every
        address), from the first push that takes this path."""
        if self.store is None:
            host = ray.util.get_node_ip_address()
            self.store, port = WeightGroup.serve(host, self.ctx.cfg.timeout_s)
            ray.get(self.ctx.driver.set_weight_store.remote(host, port))

    def _items(self, model) -> tuple[list, Iterator[tuple[str, torch.Tensor]]]:
        """(manifest, (name, whole tensor) in its order), on every trainer rank. The
        model's manifest comes from global shapes before anything is gathered, and its
        tensors are gathered one by one as the buckets fill; an adapter is gathered
        whole at once. The transfer dtype is applied as each bucket fills."""
        if self.ctx.adapter is not None:
            state = self.ctx.gather(model)
            return manifest_of(state.items(), self.ctx.cfg.dtype), iter(state.items())
        return manifest_of(model.state_dict().items(), self.ctx.cfg.dtype), iter_full(model)

    def follow(self, model) -> None:
        for _ in self._items(model)[1]:
            pass

    def push(self, model, version: int, t0: float) -> tuple[dict, dict]:
        cfg, driver = self.ctx.cfg, self.ctx.driver
        tg = time.perf_counter()
        specs, it = self._items(model)
        gathered_s = time.perf_counter() - tg  # an adapter's whole gather; ~0 for a model
        weights: dict[str, torch.Tensor] = {}
        gather_s = [0.0]  # gathering while the buckets fill (inside the send)

        def stream():
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
        self._serve_store()
        plan = ray.get(driver.begin_push.remote(version, specs, cfg.bucket_mb << 20,
                                                self.ctx.adapter))
        if plan is None:  # no replica to send to: publish through the object store
            for _ in tensors:
                pass
            stats = self.fallback.publish(version, weights)
        else:
            try:
                if self.group is None or self.group.epoch != plan["epoch"]:
                    self.group = WeightGroup(self.store, plan["epoch"], 0, plan["world"],
                                             cfg.timeout_s, cfg.backend)
                sent = self.group.send(tensors, specs, cfg.bucket_mb << 20)
                push = ray.get(driver.end_push.remote(version, plan["serial"]))
                stats = push_stats(self.path, sent["bytes"], sent["send_s"] - gather_s[0], push)
            except RuntimeError as e:  # a member died or timed out: no hang, fall back
                print(f"[areal-ray] collective push of v{version} failed ({str(e)[:120]}); "
                      "falling back to the object store", flush=True)
                self.group = None
                for _ in tensors:  # finish the gather: the other trainer ranks are in it
                    pass
                push = ray.get(driver.fallback_push.remote(
                    version, self.ctx.wrap(self.fallback.stage(version, weights))))
                stats = push_stats("object_store (fallback)", self.fallback.sent_bytes(weights),
                                   0.0, push)
        stats.update(push_gather_s=gathered_s + gather_s[0], push_total_s=time.perf_counter() - t0)
        return weights, stats

    def close(self) -> None:
        self.group = self.store = None  # the store closes its socket


_SENDERS = {"object_store": ObjectStoreSender, "disk": DiskSender, "shm": ShmSender,
            "collective": CollectiveSender}


def sender_for(path: str, ctx: SenderContext) -> StagedSender | CollectiveSender:
    """The sender of one weight path (not `auto`: that chooses among `AUTO_PATHS`)."""
    if path not in _SENDERS:
        raise ValueError(f"weights.path {path!r} is not one of auto, {', '.join(sorted(_SENDERS))}")
    return _SENDERS[path](ctx)
