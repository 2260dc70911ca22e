"""LoRA adapter pushes without Ray (weights/adapter.py, `AdapterPayload`): the payload
answers for the path payload it wraps, an adapter staged on the shm path comes out of
the replica's receiver as the same tensors with its meta, the merge is peft's and
always starts from the base."""

import asyncio

import pytest
import torch

from areal_ray.config import WeightsConfig
from areal_ray.weights.adapter import Adapter, merge_weight, merged_state
from areal_ray.weights.payloads import AdapterMeta, AdapterPayload, CollectivePayload, ObjectStorePayload
from areal_ray.weights.receivers import WeightReceiver
from areal_ray.weights.senders import SenderContext, ShmSender

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


def test_an_adapter_staged_on_shm_is_received_as_an_adapter(tmp_path):
    ctx = SenderContext(WeightsConfig(path="shm"), None, 0, tmp_path, adapter=META)
    sender = ShmSender(ctx)
    a = adapter()
    try:
        payload = ctx.wrap(sender.stage(1, a.tensors))
        assert isinstance(payload, AdapterPayload) and payload.meta == META
        got = asyncio.run(WeightReceiver("r").receive(payload))
        assert isinstance(got, Adapter) and got.meta == META
        assert got.modules == ["layers.0.q_proj"]
        assert all(torch.equal(got.tensors[k], v) for k, v in a.tensors.items())
        assert not WeightReceiver("r").streams(payload)  # loaded whole, never streamed
    finally:
        sender.close()
    # without an adapter the path's payload goes out as it is
    plain = SenderContext(WeightsConfig(path="shm"), None, 0, tmp_path)
    assert plain.wrap(ObjectStorePayload(None)) == ObjectStorePayload(None)


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
