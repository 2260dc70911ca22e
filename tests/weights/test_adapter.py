"""LoRA adapter pushes without Ray (weights/adapter.py, `AdapterPayload`): the payload
answers for the path payload it wraps, an adapter staged on the shm and disk paths or
broadcast over a gloo group comes out of the replica's receiver as the same tensors
with its meta (bit for bit), a collective push that falls back to the object store
still publishes an adapter, the merge is peft's and always starts from the base.
Through a real driver and Serve replica on every path: tests/weights/test_push.py."""

import asyncio
import threading

import pytest
import torch

from areal_ray.config import WeightsConfig
from areal_ray.weights.adapter import Adapter, merge_weight, merged_state
from areal_ray.weights.group import WeightGroup, free_port
from areal_ray.weights.payloads import AdapterMeta, AdapterPayload, CollectivePayload, ObjectStorePayload
from areal_ray.weights.receivers import WeightReceiver
from areal_ray.weights.senders import CollectiveSender, SenderContext, sender_for
from tests.weights.test_senders import DeadGroup, Driver

META = AdapterMeta("base-model", "", rank=2, alpha=4.0, scaling=2.0, targets=("q_proj",))


def adapter(seed=0, meta=META) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    return Adapter(meta, {"layers.0.q_proj.lora_A": torch.randn(2, 8, generator=g),
                          "layers.0.q_proj.lora_B": torch.randn(6, 2, generator=g)})


def test_the_adapter_payload_answers_for_the_path_payload_it_wraps():
    inner = CollectivePayload(1, ("h", 1), {"r1": 1}, 2, (), 1)
    wrapped = AdapterPayload(inner, META)
    assert wrapped.admits("r1") and not wrapped.admits("r2")
    ref = object()
    assert AdapterPayload(ObjectStorePayload(ref), META).object_refs == [ref]

    class Reowned(ObjectStorePayload):
        async def reown(self):
            return ObjectStorePayload("mine")
    got = asyncio.run(AdapterPayload(Reowned("theirs"), META).reown())
    assert got == AdapterPayload(ObjectStorePayload("mine"), META)  # still an adapter, same meta


def received_as_sent(got, a: Adapter) -> None:
    assert isinstance(got, Adapter) and got.meta == META
    assert got.modules == ["layers.0.q_proj"]
    assert got.tensors.keys() == a.tensors.keys()
    assert all(torch.equal(got.tensors[k], v) for k, v in a.tensors.items())


@pytest.mark.parametrize("path", ["shm", "disk"])
def test_an_adapter_staged_on_a_file_path_is_received_as_an_adapter(tmp_path, path):
    ctx = SenderContext(WeightsConfig(path=path), None, 0, tmp_path, adapter=META)
    sender = sender_for(path, ctx)
    receiver = WeightReceiver("r")
    try:
        for version in (1, 2, 3):  # shm alternates two files, disk keeps the last two
            a = adapter(version)
            payload = ctx.wrap(sender.stage(version, a.tensors))
            assert isinstance(payload, AdapterPayload) and payload.meta == META
            received_as_sent(asyncio.run(receiver.receive(payload)), a)
            assert not receiver.streams(payload)  # loaded whole, never streamed
    finally:
        sender.close()
    # without an adapter the path's payload goes out as it is
    plain = SenderContext(WeightsConfig(path="shm"), None, 0, tmp_path)
    assert plain.wrap(ObjectStorePayload(None)) == ObjectStorePayload(None)


class AdapterModel(torch.nn.Module):
    """What the collective sender gathers from: `SenderContext.gather` reads the
    adapter as the trainer's peft model names it (train/lora.py: adapter_state)."""

    def __init__(self, a: Adapter):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        q = self.layers[0].q_proj = torch.nn.Module()
        q.base_layer = torch.nn.Linear(8, 6, bias=False)
        q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(8, 2, bias=False)})
        q.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 6, bias=False)})
        with torch.no_grad():
            q.lora_A["default"].weight.copy_(a.tensors["layers.0.q_proj.lora_A"])
            q.lora_B["default"].weight.copy_(a.tensors["layers.0.q_proj.lora_B"])


@pytest.mark.engine  # a gloo WeightGroup between threads
def test_an_adapter_broadcast_over_gloo_is_received_as_an_adapter(monkeypatch):
    """The collective sender gathers only the adapter and broadcasts it; its manifest
    and meta reach the driver, whose payload (an `AdapterPayload` around the
    broadcast's, as `Driver.begin_push` builds it) the replicas receive."""
    from areal_ray.weights import senders
    monkeypatch.setattr(senders.ray, "get", lambda reply: reply)
    monkeypatch.setattr(senders.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    port, ids = free_port(), ("a", "b")
    store = WeightGroup.connect("127.0.0.1", port, 10, is_master=True)
    driver = Driver(None)
    announced = []

    def begin_push(version, specs, bucket, meta):
        payload = CollectivePayload(1, ("127.0.0.1", port), {r: i + 1 for i, r in enumerate(ids)},
                                    3, tuple(specs), bucket)
        announced.append(AdapterPayload(payload, meta))
        return {"epoch": 1, "world": 3, "serial": 0}
    driver.begin_push = Driver._call(begin_push)
    driver.end_push = Driver._call(lambda version, serial: {"load_s": 0.0, "replicas": 2,
                                                             "dropped": []})
    sender = CollectiveSender(SenderContext(WeightsConfig(path="collective", timeout_s=10.0),
                                            driver, 0, None, adapter=META))
    sender.store = store  # the store the replicas rendezvous at (the job serves its own)
    got, errors = {}, []

    def receive(replica_id):
        try:
            while not announced:
                threading.Event().wait(0.01)
            got[replica_id] = asyncio.run(WeightReceiver(replica_id, 10).receive(announced[0]))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    a = adapter(7)
    try:
        weights, stats = sender.push(AdapterModel(a), 1, 0.0)
    finally:
        for t in threads:
            t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert announced[0].meta == META
    assert [s.name for s in announced[0].tensors.specs] == list(a.tensors)  # the adapter alone
    assert stats["push_path"] == "collective" and stats["push_bytes"] == (2 * 8 + 6 * 2) * 4
    for r in ids:
        received_as_sent(got[r], a)
    assert all(torch.equal(weights[k], v) for k, v in a.tensors.items())  # for checkpoints


@pytest.mark.parametrize("plan,path", [
    (None, "object_store"), ({"epoch": 1, "world": 2, "serial": 0}, "object_store (fallback)")],
    ids=["no replica in the group", "failed broadcast"])
def test_a_collective_adapter_push_that_falls_back_still_publishes_an_adapter(monkeypatch, plan,
                                                                              path):
    from areal_ray.weights import senders
    monkeypatch.setattr(senders.ray, "get", lambda reply: reply)
    monkeypatch.setattr(senders.ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(senders, "put_state", lambda state: ObjectStorePayload(state))
    monkeypatch.setattr(senders, "WeightGroup", DeadGroup)
    driver = Driver(plan)
    sender = CollectiveSender(SenderContext(WeightsConfig(path="collective"), driver, 0, None,
                                            adapter=META))
    a = adapter(3)
    try:
        _, stats = sender.push(AdapterModel(a), 1, 0.0)
    finally:
        sender.close()
    [payload] = driver.published
    assert isinstance(payload, AdapterPayload) and payload.meta == META
    assert all(torch.equal(payload.tensors.ref[k], v) for k, v in a.tensors.items())
    assert stats["push_path"] == path


def test_the_merge_is_base_plus_scaled_b_a_and_never_stacks():
    a1, a2 = adapter(1), adapter(2)
    base = {"layers.0.q_proj.weight": torch.randn(6, 8), "layers.0.q_proj.bias": torch.randn(6)}
    m1 = merged_state(base, a1)
    A, B = a1.pair("layers.0.q_proj")
    want = base["layers.0.q_proj.weight"].clone()
    want += (B @ A) * 2.0  # peft's Linear.merge: weight += get_delta_weight (float32)
    assert torch.equal(m1["layers.0.q_proj.weight"], want)
    assert m1["layers.0.q_proj.bias"] is base["layers.0.q_proj.bias"]
    m2 = merged_state(base, a2)  # from the base, not from m1
    A2, B2 = a2.pair("layers.0.q_proj")
    assert torch.equal(m2["layers.0.q_proj.weight"],
                       base["layers.0.q_proj.weight"] + (B2 @ A2) * 2.0)
    # bf16 bases are merged in float32 and rounded once
    w = torch.randn(6, 8).to(torch.bfloat16)
    assert merge_weight(w, A, B, 2.0).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="the base model does not have"):
        merged_state({}, a1)


@pytest.mark.parametrize("tensors,match", [
    ({"m.lora_A": torch.zeros(2, 4)}, "adapter of m lacks"),
    ({"m.lora_A": torch.zeros(3, 4), "m.lora_B": torch.zeros(4, 3)}, "are not of rank 2"),
    ({"m.weight": torch.zeros(2, 4)}, "neither lora_A nor lora_B"),
])
def test_a_malformed_adapter_is_refused(tensors, match):
    with pytest.raises(ValueError, match=match):
        Adapter(META, tensors).check()
