"""Weight sync: pushing a new policy version from trainer rank 0 to every replica.

Four paths (`weights.path`; `auto` picks `shm` or `collective`), each a payload type
(`areal_ray/weights/payloads.py`) the driver hands to replicas; the trainer sends
through one sender per path (`areal_ray/weights/senders.py`), each replica
receives through one receiver per path (`areal_ray/weights/receivers.py`):

* `collective` (default on a cluster): a standalone process group (gloo on CPU, NCCL on
  GPU) of trainer rank 0 and the rollout replicas, broadcasting flat buckets
  (`areal_ray/weights/group.py`, with how it fails on NCCL). When a broadcast fails, the
  same version goes out through the object store.
* `object_store`: one `ray.put` of the full state dict (`put_state`), every replica
  reads it (also the fallback when a collective push fails).
* `disk`: an HF safetensors file on shared storage, for engines that load from disk.
* `shm`: for replicas on the trainer's node, shared-memory files (/dev/shm) that
  rank 0 rewrites in place, two alternating; every replica maps the current one and
  its load is the only copy on its side. This is the path that comes near memory
  bandwidth on one machine (`benchmarks/bench_weights.py`); it cannot reach other nodes.

Every weight file asks `staging.py` where it fits (shared memory, else disk).

This module holds what both ends share: the manifest, the object-store and
shared-memory encodings, and the digest that tells whether two ends hold the same
weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from areal_ray.cluster.ownership import Owned
from areal_ray.weights.group import NCCL_ENV, WeightGroup, free_port  # noqa: F401 - re-exported
from areal_ray.weights.payloads import ObjectStorePayload, ShmPayload
from areal_ray.weights.staging import staging_dir
from areal_ray.weights.tensor_spec import TensorSpec, plan_buckets  # noqa: F401 - re-exported


def manifest_of(state: Iterable[tuple[str, torch.Tensor]], dtype: str = "") -> list[TensorSpec]:
    """Specs in send order; `dtype` converts for the receiver (empty: keep)."""
    return [TensorSpec(k, tuple(v.shape), dtype or str(v.dtype).removeprefix("torch."))
            for k, v in state]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def memcpy_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """This machine's memcpy bandwidth in bytes/s: one thread copying `nbytes` between
    two buffers (best of `repeats`), the yardstick a push's bytes/s is compared to."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # plain memcpy: torch would split a large copy over threads
    try:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best


class SharedMemoryWeights:
    """Rank 0's side of the `shm` path: two files in /dev/shm, sized once and rewritten
    in place, alternating. A push completes (every replica acked) before the next one
    starts, so the file being written was last read two pushes ago, by replicas that
    have all moved on; a replica that registers late reads the other one. Each file is
    placed where it fits when it is created (`staging_dir`); the payload names it.

    With `owner` (the job's tag) the files are named for `ownership.Owned`, with this
    process's pid, so a sweep can tell whose they are once the writer or its job is
    gone (areal_ray/cluster/ownership.py); without, by `name` (benchmarks, tests)."""

    def __init__(self, name: str = "", owner: str = ""):
        if not (name or owner):
            raise ValueError("SharedMemoryWeights needs a name or an owner tag")
        if owner:
            Owned(owner)  # a tag that is not one fails here, not at the first push
        self.name, self.owner = name, owner
        self.paths: list[Path | None] = [None, None]
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.slot = 1

    def _create(self, slot: int, total: int) -> torch.Tensor:
        """A fresh file of `total` bytes for `slot`, mapped; the old one (another size) goes."""
        self.bufs[slot] = None
        if self.paths[slot] is not None:
            self.paths[slot].unlink(missing_ok=True)
        from areal_ray.cluster.cleanup import weight_file_name
        rest = f"{slot}.bin" if self.owner else f"{self.name}-{slot}.bin"
        path = self.paths[slot] = staging_dir(total) / weight_file_name("weights", self.owner, rest)
        return torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)

    def write(self, tensors: Iterable[torch.Tensor], specs: list[TensorSpec]) -> ShmPayload:
        self.slot = 1 - self.slot
        offsets, total = [], 0
        for sp in specs:
            offsets.append(total)
            total += sp.nbytes
        buf = self.bufs[self.slot]
        if buf is None or buf.numel() != total:
            buf = self.bufs[self.slot] = self._create(self.slot, total)
        for sp, off, t in zip(specs, offsets, tensors):
            buf[off:off + sp.nbytes].view(_dtype(sp.dtype)).copy_(t.reshape(-1))
        return ShmPayload(str(self.paths[self.slot]), total, tuple(specs), tuple(offsets))

    def unlink(self) -> None:
        self.bufs = [None, None]
        for p in self.paths:
            if p is not None:
                p.unlink(missing_ok=True)


def read_shared(payload: ShmPayload, maps: dict | None = None) -> dict[str, torch.Tensor]:
    """Views into the mapped file: no copy until the engine loads them. `maps` keeps
    mappings between pushes, so their page tables are filled only once."""
    key = (payload.path, payload.size)
    buf = maps.get(key) if maps is not None else None
    if buf is None:
        buf = torch.from_file(payload.path, shared=True, size=payload.size, dtype=torch.uint8)
        if maps is not None:
            maps[key] = buf
    out = {}
    for sp, off in zip(payload.specs, payload.offsets):
        out[sp.name] = buf[off:off + sp.nbytes].view(_dtype(sp.dtype)).view(sp.shape)
    return out


def put_state(state: dict[str, torch.Tensor]) -> ObjectStorePayload:
    """The object-store path: one `ray.put` of the tensors as raw numpy byte arrays,
    which Ray stores with one copy and hands to every reader as zero-copy views of
    shared memory (pickled torch tensors would be copied again on every read)."""
    import ray
    return ObjectStorePayload(ray.put({
        k: (v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(),
            str(v.dtype).removeprefix("torch."), tuple(v.shape))
        for k, v in state.items()}))


def state_from(stored: dict) -> dict[str, torch.Tensor]:
    """Tensors viewing what `put_state` stored (read-only memory: load, don't write)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": we only read
        return {k: torch.from_numpy(a).view(_dtype(d)).reshape(shape)
                for k, (a, d, shape) in stored.items()}


def digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of names and exact bytes: equal digests mean bit-identical weights."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
