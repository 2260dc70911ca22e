"""The two factories of the weight paths without Ray: each trainer-side sender's
payload goes through the replica-side receiver the payload picks and comes out as
the same state dict (disk and shared memory here; the collective path over gloo on
localhost; the object store and the driver's part are in tests/weights/test_push.py)."""

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from areal_ray.config import WeightsConfig
from areal_ray.weights.encoding import digest, manifest_of
from areal_ray.weights.group import WeightGroup, free_port
from areal_ray.weights.payloads import (
    CollectivePayload,
    DiskPayload,
    ObjectStorePayload,
    ShmPayload,
    WeightPayload,
)
from areal_ray.weights.receivers import (
    CollectiveReceiver,
    DiskReceiver,
    ObjectStoreReceiver,
    ShmReceiver,
    WeightReceiver,
)
from areal_ray.weights.senders import (
    CollectiveSender,
    DiskSender,
    ObjectStoreSender,
    SenderContext,
    ShmSender,
    sender_for,
)
from areal_ray.weights.tensor_spec import TensorSpec


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(50, 16, generator=g),
            "layers.0.w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
            "norm.bias": torch.randn(16, generator=g), "step": torch.tensor([3], dtype=torch.int64)}


def ctx(tmp_path: Path, path: str, dtype: str = "", rank: int = 0) -> SenderContext:
    # driver=None: staging a payload never calls the driver (publishing does)
    return SenderContext(WeightsConfig(path=path, dtype=dtype), None, rank, tmp_path / "weights")


@pytest.mark.parametrize("path,sender,receiver,payload", [
    ("object_store", ObjectStoreSender, ObjectStoreReceiver, ObjectStorePayload(object())),
    ("disk", DiskSender, DiskReceiver, DiskPayload("/x")),
    ("shm", ShmSender, ShmReceiver, ShmPayload("/x", 0, (), ())),
    ("collective", CollectiveSender, CollectiveReceiver,
     CollectivePayload(1, ("h", 1), {}, 1, (), 1)),
])
def test_each_path_has_one_sender_and_one_receiver(tmp_path, path, sender, receiver, payload):
    s = sender_for(path, ctx(tmp_path, path, rank=1))  # rank 1: the collective serves no store
    assert type(s) is sender and s.path == path
    r = WeightReceiver("r")
    assert type(r.receiver_for(payload)) is receiver
    assert r.receiver_for(payload) is r.receiver_for(payload)  # kept between pushes


def test_unknown_paths_and_payloads_are_named(tmp_path):
    with pytest.raises(ValueError, match="'auto' is not one of auto, collective, disk"):
        sender_for("auto", ctx(tmp_path, "auto"))  # auto chooses among senders; it is none
    with pytest.raises(ValueError, match="'nfs'"):
        sender_for("nfs", ctx(tmp_path, "nfs"))
    with pytest.raises(TypeError, match="no weight receiver for WeightPayload"):
        WeightReceiver("r").receiver_for(WeightPayload())


@pytest.mark.parametrize("path", ["disk", "shm"])
@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_staged_paths_round_trip_a_state_dict(tmp_path, path, dtype):
    sender = sender_for(path, ctx(tmp_path, path, dtype))
    receiver = WeightReceiver("r")
    try:
        for version in (1, 2, 3):  # shm alternates two files; disk keeps the last two
            sd = state(version)
            got = asyncio.run(receiver.receive(sender.stage(version, sd)))
            if dtype:  # every path publishes in weights.dtype
                sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
            assert digest(got) == digest(sd)
    finally:
        sender.close()
    if path == "disk":
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [
            "v2.safetensors", "v3.safetensors"]
    else:
        assert not any(Path(p).exists() for p in sender.shm.paths)  # close() removed them


def test_shm_receiver_keeps_both_files_mapped(tmp_path):
    sender = sender_for("shm", ctx(tmp_path, "shm"))
    receiver = WeightReceiver("r")
    try:
        for version in (1, 2, 3, 4):
            asyncio.run(receiver.receive(sender.stage(version, state(version))))
        assert len(receiver.receiver_for(sender.stage(5, state(5)))._maps) == 2
    finally:
        sender.close()


@pytest.mark.engine  # a gloo WeightGroup between processes or threads
def test_collective_round_trip_over_gloo():
    sd = state()
    specs = tuple(manifest_of(sd.items()))
    port = free_port()
    store = WeightGroup.connect("127.0.0.1", port, 10, is_master=True)
    payload = CollectivePayload(1, ("127.0.0.1", port), {"a": 1, "b": 2}, 3, specs, 4096)
    # "b" receives for an engine that loads from host memory (vLLM): a copy per tensor
    receivers = {r: WeightReceiver(r, timeout_s=10, host=r == "b") for r in ("a", "b")}
    got, errors = {}, []

    def receive(replica_id):
        try:
            for _ in range(2):  # the second push reuses the epoch's group
                got[replica_id] = asyncio.run(receivers[replica_id].receive(payload))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in receivers]
    for t in threads:
        t.start()
    group = WeightGroup(store, 1, 0, 3, timeout_s=10)
    for _ in range(2):
        group.send(iter(sd.values()), list(specs), 4096)
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert digest(got["a"]) == digest(got["b"]) == digest(sd)
    assert receivers["a"].receiver_for(payload)._group.transfers == 2
    # "b"'s tensors are copies: none holds a received bucket alive
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in got["b"].values())


def test_a_receiver_outside_the_group_is_told_so():
    payload = CollectivePayload(1, ("127.0.0.1", 1), {"b": 1}, 2,
                                (TensorSpec("w", (1,), "float32"),), 4096)
    with pytest.raises(ValueError, match="replica a is not in the group of epoch 1"):
        asyncio.run(WeightReceiver("a").receive(payload))
