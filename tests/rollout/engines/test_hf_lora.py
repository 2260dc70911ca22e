"""HFEngine applies pushed LoRA adapters (`update_adapter`): a real trainer (FSDP2 on a
one-rank gloo group, peft's adapter) trains, its adapter goes through the shm path's
sender and the replica's receiver, and the engine then computes with exactly the
trainer's merged weights, bit for bit; each adapter is merged from the base (no
stacking); an adapter of another base is refused with nothing written; and requests in
flight across an adapter push keep exact per-token versions (invariant 4)."""

import asyncio
import dataclasses

import pytest
import torch

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.config import WeightsConfig, load_config
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.interruptible import generate_interruptible
from areal_ray.train.fsdp import load_sharded_model
from areal_ray.train.lora import adapter_meta, adapter_state, trainable_parameters
from areal_ray.weights.adapter import Adapter, merged_state
from areal_ray.weights.encoding import digest
from areal_ray.weights.receivers import WeightReceiver
from areal_ray.weights.senders import SenderContext, ShmSender
from tests.rollout.test_interruptible import push_during

LORA = ["model.lora.enabled=true", "weights.path=shm", "model.lora.rank=4", "model.lora.alpha=8"]


@pytest.fixture
def trainer(random_model_dir, one_rank_group):
    """A LoRA policy as the trainer builds it, and a function that takes one optimizer
    step on a random loss and returns what the next push carries."""
    cfg = load_config(None, LORA)
    torch.manual_seed(0)
    policy = load_sharded_model(random_model_dir, lora=cfg.model.lora)
    opt = torch.optim.AdamW(trainable_parameters(policy), lr=5e-2)
    meta = adapter_meta(policy, cfg.model.lora, random_model_dir, "float32")

    def step(seed: int) -> Adapter:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, 60, (2, 12), generator=g)
        opt.zero_grad()
        (policy(input_ids=ids).logits.float() ** 2).mean().backward()
        opt.step()
        return Adapter(meta, adapter_state(policy))
    return step


def shm_push(tmp_path, adapter: Adapter, version: int) -> Adapter:
    """Trainer side: the shm sender stages the adapter; replica side: the receiver."""
    ctx = SenderContext(WeightsConfig(path="shm"), None, 0, tmp_path, adapter=adapter.meta)
    sender = ShmSender(ctx)
    try:
        payload = ctx.wrap(sender.stage(version, adapter.tensors))
        got = asyncio.run(WeightReceiver("replica").receive(payload))
        return Adapter(got.meta, {k: v.clone() for k, v in got.tensors.items()})
    finally:
        sender.close()


def test_after_a_push_the_engine_serves_the_trainers_merged_weights_bit_for_bit(
        random_model_dir, trainer, tmp_path):
    engine = HFEngine(random_model_dir)
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    for version in (1, 2):
        adapter = trainer(seed=version)
        info = asyncio.run(engine.update_adapter(shm_push(tmp_path, adapter, version), version))
        assert engine.version == version and info["adapter_modules"] == 14
        # the trainer's merged model (what checkpoints and final_model/ hold)
        want = merged_state(base, adapter)
        served = engine.model.state_dict()
        assert served.keys() == want.keys()
        assert all(torch.equal(served[k], want[k]) for k in want), version
        assert digest(served) == digest(want)
        changed = {k for k in want if not torch.equal(want[k], base[k])}
        assert changed and all(k.endswith("proj.weight") for k in changed)
    # version 2 is base + adapter 2: merging it onto version 1's weights would differ
    stacked = merged_state(merged_state(base, trainer(seed=1)), adapter)
    assert any(not torch.equal(stacked[k], served[k]) for k in changed)


def test_an_adapter_of_another_base_is_refused_and_nothing_is_written(random_model_dir, trainer,
                                                                      tmp_path):
    engine = HFEngine(random_model_dir)
    before = digest(engine.model.state_dict())
    adapter = trainer(seed=1)
    other = Adapter(dataclasses.replace(adapter.meta, base_digest="0" * 64), adapter.tensors)
    with pytest.raises(ValueError, match="base digests differ"):
        asyncio.run(engine.update_adapter(other, 1))
    assert engine.version == 0 and digest(engine.model.state_dict()) == before
    assert engine.load()["paused"] is None  # admission reopened
    # a full weight load makes its weights the base of the adapters after it
    new_base = {k: v * 1.01 for k, v in engine.model.state_dict().items()}
    asyncio.run(engine.update_weights(new_base, 1))
    asyncio.run(engine.update_adapter(Adapter(dataclasses.replace(adapter.meta, base_digest=""),
                                              adapter.tensors), 2))
    served = engine.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in merged_state(new_base, adapter).items())


def test_requests_in_flight_keep_exact_versions_across_an_adapter_push(random_model_dir, trainer,
                                                                       tmp_path):
    engine = HFEngine(random_model_dir)
    adapter = shm_push(tmp_path, trainer(seed=1), 1)
    budget, prompt = 200, [5, 6, 7, 8]

    async def gen(ids, n, temperature):
        res = await engine.generate(GenerationRequest(ids, n, temperature, ignore_eos=True))
        return res.to_dict()

    class AdapterPush:  # push_during's engine, whose update is the adapter's
        def load(self):
            return engine.load()

        async def update_weights(self, _state, version):
            return await engine.update_adapter(adapter, version)

    torch.manual_seed(0)
    sample = asyncio.run(push_during(AdapterPush(), generate_interruptible(gen, prompt, budget, 1.0),
                                     None))
    assert len(sample.output_ids) == budget and sample.n_resubmits >= 1
    k = sample.versions.index(1)
    assert 0 < k < budget and sample.versions == [0] * k + [1] * (budget - k)
    # the resumed tokens' logprobs are the adapted weights' (KV recomputed after the push)
    b = pad_batch([dict(prompt_ids=prompt, output_ids=sample.output_ids, logprobs=sample.logprobs,
                        versions=sample.versions, advantage=0.0)], engine.pad_id)
    tf = token_logprobs(engine.model, b["input_ids"], b["attention_mask"], 1.0)[b["loss_mask"]]
    beh = b["behavior_logprobs"][b["loss_mask"]]
    assert torch.allclose(tf[k:], beh[k:], atol=1e-4)
    assert not torch.allclose(tf[:k], beh[:k], atol=1e-4)  # earlier tokens: the base's
