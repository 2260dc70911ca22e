"""What a weight publication carries: one frozen dataclass per path, importable without
torch or ray.

The driver actor keeps the latest payload and hands it to every replica; Ray Data and
Ray Train processes relay it too. Defining payloads next to the torch code would make
each of those processes import torch to unpickle one (seconds, ~300 MB each), so they
live here, as `TensorSpec` does in `tensor_spec.py`.

`None` in place of a payload means one thing: nothing has been published yet, and the
replicas serve the model they loaded from disk at version 0.

A payload answers the few questions the driver and the replicas ask about it
(`admits`, `object_refs`, `reown`), so no caller inspects which path it came by; the
one place that does is each side's factory (`weight_receivers.receiver_for` on
replicas, `train.weight_senders.sender_for` on the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_ray.weights.tensor_spec import TensorSpec


@dataclass(frozen=True)
class WeightPayload:
    """What every payload answers; the defaults fit every path but the exceptions."""

    def admits(self, replica_id: str) -> bool:
        """Whether this replica can load the publication. Only a collective broadcast
        formed before the replica registered leaves it out."""
        return True

    @property
    def object_refs(self) -> list | None:
        """`[ref]` of the object holding the weights in Ray's object store, or None when
        they travel some other way."""
        return None

    async def reown(self) -> WeightPayload:
        """This payload with anything the publishing process owns made the caller's:
        object-store objects die with the process that put them, so the driver keeps
        the last weights past the trainer's end through this. Files stay as they are."""
        return self


@dataclass(frozen=True)
class ObjectStorePayload(WeightPayload):
    """One `ray.put` of the state dict (`weights.put_state`), read by every replica. The
    ref sits inside the payload, so Ray passes it along as a ref instead of resolving
    it when the payload is a call's argument."""
    ref: Any  # ray.ObjectRef; typed loosely so that this module needs no ray

    @property
    def object_refs(self) -> list:
        return [self.ref]

    async def reown(self) -> ObjectStorePayload:
        import ray  # only in a process that holds refs, which has ray already
        return ObjectStorePayload(ray.put(await self.ref))


@dataclass(frozen=True)
class DiskPayload(WeightPayload):
    """A safetensors file on storage every replica reads."""
    path: str


@dataclass(frozen=True)
class ShmPayload(WeightPayload):
    """A shared-memory file of the trainer's node: `size` bytes holding each tensor of
    `specs` at its offset in `offsets`."""
    path: str
    size: int
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]

    def __post_init__(self):
        if len(self.specs) != len(self.offsets):
            raise ValueError(f"shm payload {self.path}: {len(self.specs)} specs but "
                             f"{len(self.offsets)} offsets")


@dataclass(frozen=True)
class CollectivePayload(WeightPayload):
    """A broadcast from trainer rank 0 (rank 0) to the replicas of one group epoch,
    which rendezvous through the trainer's store at `store` (host, port)."""
    epoch: int
    store: tuple[str, int]
    ranks: dict[str, int]  # replica id -> its rank in the group
    world: int
    specs: tuple[TensorSpec, ...]
    bucket_bytes: int

    def admits(self, replica_id: str) -> bool:
        return replica_id in self.ranks


@dataclass(frozen=True)
class AdapterMeta:
    """What a replica needs to apply a LoRA adapter: the base it was trained on (`base`,
    the model's id, and `base_digest`, the sha256 of the base weights of the adapted
    modules in `model.dtype`, `encoding.digest`; empty: not checked), its shape (`rank`,
    `alpha`, the `targets` peft matched) and `scaling`, the factor of B @ A."""
    base: str
    base_digest: str
    rank: int
    alpha: float
    scaling: float
    targets: tuple[str, ...]

    @classmethod
    def from_config(cls, lora, base: str, base_digest: str = "") -> AdapterMeta:
        """From `model.lora` (a `config.LoraConfig`)."""
        return cls(base, base_digest, lora.rank, lora.alpha, lora.scaling,
                   tuple(lora.target_modules))


@dataclass(frozen=True)
class AdapterPayload(WeightPayload):
    """An adapter of base `meta.base` (not full weights): `tensors` is the path's own
    payload, carrying `<module>.lora_A` and `<module>.lora_B` per adapted module
    (`weights/adapter.py`). The replica applies it with `InferenceEngine.update_adapter`,
    from the base weights it keeps; the publication's version is the adapter's."""
    tensors: WeightPayload
    meta: AdapterMeta

    def admits(self, replica_id: str) -> bool:
        return self.tensors.admits(replica_id)

    @property
    def object_refs(self) -> list | None:
        return self.tensors.object_refs

    async def reown(self) -> AdapterPayload:
        return AdapterPayload(await self.tensors.reown(), self.meta)
