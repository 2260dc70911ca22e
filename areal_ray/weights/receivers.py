"""A rollout replica's side of the weight paths: one receiver per payload type, each
turning a publication into a state dict the engine loads.

Tensors may be views (into Ray's shared memory, a mapped /dev/shm file or a received
bucket): the engine's load is then the one copy on the replica's side. Receivers that
block (file reads, a broadcast) run in a thread, so the replica keeps generating while
weights arrive; only the engine's swap holds generation.

`WeightReceiver.receiver_for` is the one place that maps a payload type to its
receiver. An `AdapterPayload` (a LoRA adapter, `model.lora`) wraps another path's
payload: its receiver receives that one and hands the engine an `Adapter` (the
tensors and the meta) instead of a state dict. A replica keeps one receiver per path for its lifetime because two of them
hold state between pushes: the shm receiver its file mappings (their page tables are
filled once), the collective one its group of the current epoch.

The collective receiver can also hand the broadcast over bucket by bucket (`stream`),
for an engine that loads each bucket as it arrives (`SGLangEngine.
update_weights_from_buckets`): the replica then never holds the whole model on its GPU.
For an engine that loads from host memory anyway (vLLM stages a file), `host` receivers
copy each bucket's tensors to the host as it arrives, so again only a bucket or two is
ever on the replica's GPU, and the cached blocks go back to the driver after the
transfer (`free_cuda_cache`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from areal_ray.weights.adapter import Adapter
from areal_ray.weights.encoding import read_shared, state_from
from areal_ray.weights.group import WeightGroup
from areal_ray.weights.payloads import (
    AdapterPayload,
    CollectivePayload,
    DiskPayload,
    ObjectStorePayload,
    ShmPayload,
    WeightPayload,
)
from areal_ray.weights.tensor_spec import plan_buckets

StateDict = dict[str, torch.Tensor]
Bucket = list[tuple[str, torch.Tensor]]


def free_cuda_cache() -> None:
    """Hand this process's cached CUDA blocks back to the driver. A replica uses CUDA
    only for received weights (and casts of them); torch's caching allocator would keep
    those blocks reserved after a swap, outside the engine's share of the GPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class ObjectStoreReceiver:
    """Awaits the object: Ray hands it over as zero-copy views of its shared memory."""

    async def receive(self, payload: ObjectStorePayload) -> StateDict:
        return state_from(await payload.ref)


class DiskReceiver:
    async def receive(self, payload: DiskPayload) -> StateDict:
        from safetensors.torch import load_file
        return await asyncio.to_thread(load_file, payload.path)


class ShmReceiver:
    """Maps the trainer's shared-memory files and keeps them mapped between pushes."""

    def __init__(self):
        self._maps: dict = {}

    async def receive(self, payload: ShmPayload) -> StateDict:
        if len(self._maps) > 2:  # the trainer alternates two files: more is a new run or size
            self._maps.clear()
        return await asyncio.to_thread(read_shared, payload, self._maps)


class CollectiveReceiver:
    """Joins the broadcast of the payload's epoch, re-forming its group when the epoch
    changed. A failed transfer raises and drops the group: the trainer publishes the
    same version through the object store next, which the replica then loads."""

    def __init__(self, replica_id: str, timeout_s: float, backend: str, host: bool = False):
        self.replica_id, self.timeout_s, self.backend = replica_id, timeout_s, backend
        self.host = host  # `receive` copies each tensor to the host as its bucket arrives
        self._group: WeightGroup | None = None
        self._store_key: tuple[str, int] | None = None
        self._store = None
        self._pool: ThreadPoolExecutor | None = None  # stream()'s thread, made on first use

    async def receive(self, payload: CollectivePayload) -> StateDict:
        return await asyncio.to_thread(self._receive, payload)

    def _receive(self, payload: CollectivePayload) -> StateDict:
        try:
            group = self._group_for(payload)
            tensors = group.recv(payload.specs, payload.bucket_bytes)
            if not self.host:
                return dict(tensors)
            # Each tensor in its own host memory: no bucket buffer outlives its copy.
            out = {name: t.to("cpu", copy=True) for name, t in tensors}
        except Exception:
            self._group = None
            raise
        free_cuda_cache()
        return out

    async def stream(self, payload: CollectivePayload) -> AsyncIterator[Bucket]:
        """The broadcast one bucket at a time: (name, tensor) views into the bucket, valid
        until the caller drops them; the next bucket is on the wire meanwhile. Every step
        runs on this receiver's one thread, so the group's calls never change threads
        mid-transfer. A failed or abandoned transfer drops the group, as `receive` does."""
        loop = asyncio.get_running_loop()
        pool = self._thread()
        buckets = self._buckets(payload)
        try:
            while True:
                bucket = await loop.run_in_executor(pool, next, buckets, None)
                if bucket is None:
                    return
                yield bucket
                del bucket  # the consumer's copy is the only one left: it frees the bucket
        finally:
            await loop.run_in_executor(pool, buckets.close)

    def _buckets(self, payload: CollectivePayload) -> Iterator[Bucket]:
        """`group.recv`'s tensors grouped by the buckets they arrive in (the same plan)."""
        done = False
        try:
            group = self._group_for(payload)
            sizes = iter([len(b) for b in plan_buckets(list(payload.specs), payload.bucket_bytes)])
            bucket, want = [], next(sizes, 0)
            for name, t in group.recv(payload.specs, payload.bucket_bytes):
                bucket.append((name, t))
                if len(bucket) == want:
                    yield bucket
                    bucket, want = [], next(sizes, 0)
            done = True
        finally:
            if not done:  # a broken or abandoned broadcast leaves the group unusable
                self._group = None

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-stream")
        return self._pool

    def _group_for(self, payload: CollectivePayload) -> WeightGroup:
        if self._group is not None and self._group.epoch == payload.epoch:
            return self._group
        if self.replica_id not in payload.ranks:
            raise ValueError(f"replica {self.replica_id} is not in the group of epoch "
                             f"{payload.epoch} (members: {sorted(payload.ranks)})")
        host, port = payload.store
        if self._store_key != (host, port):
            self._store = WeightGroup.connect(host, port, self.timeout_s)
            self._store_key = (host, port)
        self._group = WeightGroup(self._store, payload.epoch, payload.ranks[self.replica_id],
                                  payload.world, self.timeout_s, self.backend)
        return self._group


class AdapterReceiver:
    """The wrapped payload's tensors, through that path's receiver, as an `Adapter`."""

    def __init__(self, receivers: WeightReceiver):
        self.receivers = receivers

    async def receive(self, payload: AdapterPayload) -> Adapter:
        adapter = Adapter(payload.meta, await self.receivers.receive(payload.tensors))
        adapter.check()
        return adapter


# Each payload type's receiver, built from the replica's (id, timeout_s, backend, host).
_RECEIVERS = {
    ObjectStorePayload: lambda *_: ObjectStoreReceiver(),
    DiskPayload: lambda *_: DiskReceiver(),
    ShmPayload: lambda *_: ShmReceiver(),
    CollectivePayload: CollectiveReceiver,
}


class WeightReceiver:
    """One replica's receivers, one per path, each made when its first payload comes.
    `host`: a whole received model goes to host memory (the engine's `loads_from_host`)."""

    def __init__(self, replica_id: str, timeout_s: float = 60.0, backend: str = "gloo",
                 host: bool = False):
        self.replica_id, self.timeout_s, self.backend = replica_id, timeout_s, backend
        self.host = host
        self._receivers: dict[type, object] = {}

    def receiver_for(self, payload: WeightPayload):
        """The receiver of `payload`'s path (the one dispatch on payload types)."""
        kind = type(payload)
        if kind not in self._receivers:
            if kind is AdapterPayload:  # around another path's payload: receives through it
                self._receivers[kind] = AdapterReceiver(self)
            elif kind not in _RECEIVERS:
                raise TypeError(f"no weight receiver for {kind.__name__}: a payload is one of "
                                f"{', '.join(t.__name__ for t in _RECEIVERS)}, or an "
                                f"{AdapterPayload.__name__} around one")
            else:
                self._receivers[kind] = _RECEIVERS[kind](self.replica_id, self.timeout_s,
                                                         self.backend, self.host)
        return self._receivers[kind]

    async def receive(self, payload: WeightPayload) -> StateDict | Adapter:
        """The publication's state dict (an `Adapter` for an adapter's). Raises if a
        collective transfer fails."""
        return await self.receiver_for(payload).receive(payload)

    def streams(self, payload: WeightPayload) -> bool:
        """Whether `payload`'s path hands its tensors over bucket by bucket (`stream`)."""
        return hasattr(self.receiver_for(payload), "stream")

    def stream(self, payload: WeightPayload) -> AsyncIterator[Bucket]:
        """The publication's (name, tensor) buckets as they arrive (see `streams`)."""
        return self.receiver_for(payload).stream(payload)
