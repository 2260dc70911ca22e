"""The payload types of the weight paths: what each answers the driver and the
replicas (who may load it, which object-store refs it holds, what the driver keeps
after the trainer is gone), and that the module stays light to import."""

import asyncio
import subprocess
import sys

import pytest

from areal_ray.weights.payloads import (
    CollectivePayload,
    DiskPayload,
    ObjectStorePayload,
    ShmPayload,
)
from areal_ray.weights.tensor_spec import TensorSpec

SPECS = (TensorSpec("w", (2, 3), "float32"), TensorSpec("b", (3,), "float32"))


def collective(ranks=None):
    return CollectivePayload(epoch=1, store=("127.0.0.1", 1234), ranks=ranks or {"b": 1},
                             world=2, specs=SPECS, bucket_bytes=1 << 20)


EVERY_PATH = {
    "object_store": lambda: ObjectStorePayload(ref=object()),
    "disk": lambda: DiskPayload("/tmp/v1.safetensors"),
    "shm": lambda: ShmPayload("/dev/shm/x", 36, SPECS, (0, 24)),
    "collective": collective,
}


def test_a_replica_outside_the_group_waits_for_the_next_publication():
    payload = collective({"b": 1})
    assert not payload.admits("a")
    assert payload.admits("b")


@pytest.mark.parametrize("path", ["object_store", "disk", "shm"])
def test_every_other_payload_admits_every_replica(path):
    payload = EVERY_PATH[path]()
    assert payload.admits("a") and payload.admits("any replica")


@pytest.mark.parametrize("path", ["disk", "shm", "collective"])
def test_only_the_object_store_holds_refs_and_the_rest_are_kept_as_they_are(path):
    payload = EVERY_PATH[path]()
    assert payload.object_refs is None
    assert asyncio.run(payload.reown()) is payload


def test_the_object_store_payload_hands_out_its_ref():
    ref = object()
    assert ObjectStorePayload(ref).object_refs == [ref]


@pytest.mark.parametrize("path", sorted(EVERY_PATH))
def test_payloads_are_frozen(path):
    payload = EVERY_PATH[path]()
    field = next(iter(payload.__dataclass_fields__))
    with pytest.raises(AttributeError):
        setattr(payload, field, None)


def test_a_shm_payload_needs_one_offset_per_tensor():
    with pytest.raises(ValueError, match="2 specs but 1 offsets"):
        ShmPayload("/dev/shm/x", 36, SPECS, (0,))


def test_the_payload_module_imports_neither_torch_nor_ray():
    code = ("import sys, areal_ray.weights.payloads; "
            "print(' '.join(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    assert out.stdout.split() == []
