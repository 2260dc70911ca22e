"""Interruptible rollout: resubmission keeps the budget, versions step at the resume point,
and the resumed tokens' logprobs are those of the new weights (invariant 4, docs/architecture.md)."""

import asyncio

import torch

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.interruptible import generate_group, generate_interruptible


async def push_during(engine, generation, new_state):
    """Run `generation`; once the engine is generating, push `new_state` as version 1."""
    task = asyncio.ensure_future(generation)
    while engine.load()["running"] == 0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    await engine.update_weights(new_state, version=1)
    return await task


def test_interrupted_generation_finishes_with_full_budget(random_model_dir):
    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    new_state = {k: v * 1.05 for k, v in engine.model.state_dict().items()}
    budget, prompt = 240, [5, 6, 7, 8]  # within the model's 256-token context

    async def gen(ids, n, temperature):
        res = await engine.generate(GenerationRequest(ids, n, temperature, ignore_eos=True))
        return {"output_ids": res.output_ids, "logprobs": res.logprobs,
                "versions": res.versions, "stop_reason": res.stop_reason}

    sample = asyncio.run(push_during(engine, generate_interruptible(gen, prompt, budget, 1.0), new_state))
    assert len(sample.output_ids) == budget and sample.stop_reason == "length"
    assert sample.n_resubmits >= 1
    k = sample.versions.index(1)  # the resume point
    assert 0 < k < budget
    assert sample.versions == [0] * k + [1] * (budget - k)
    # After the resume the logprobs are the new weights' (KV recomputed from scratch).
    b = pad_batch([dict(prompt_ids=prompt, output_ids=sample.output_ids, logprobs=sample.logprobs,
                        versions=sample.versions, advantage=0.0)], engine.pad_id)
    tf = token_logprobs(engine.model, b["input_ids"], b["attention_mask"], 1.0)[b["loss_mask"]]
    beh = b["behavior_logprobs"][b["loss_mask"]]
    assert torch.allclose(tf[k:], beh[k:], atol=1e-4)
    assert not torch.allclose(tf[:k], beh[:k], atol=1e-4)  # old tokens came from other weights


def test_a_group_resubmits_its_aborted_samples_in_one_round(random_model_dir):
    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    new_state = {k: v * 1.05 for k, v in engine.model.state_dict().items()}
    budget, prompt, n = 120, [5, 6, 7, 8], 4
    rounds = []

    async def generate_batch(ids_list, budgets, temperature):
        rounds.append(list(budgets))
        results = await asyncio.gather(*[engine.generate(GenerationRequest(ids, b, temperature, ignore_eos=True))
                                         for ids, b in zip(ids_list, budgets)])
        return [r.to_dict() for r in results]

    samples = asyncio.run(push_during(engine, generate_group(generate_batch, prompt, n, budget, 1.0),
                                      new_state))
    assert len(rounds) >= 2 and rounds[0] == [budget] * n
    assert len(rounds[1]) == n and all(0 < b < budget for b in rounds[1])  # all were running: all resumed
    for s in samples:
        assert len(s.output_ids) == budget and s.n_resubmits >= 1 and s.prompt_ids == prompt
        k = s.versions.index(1)
        assert s.versions == [0] * k + [1] * (budget - k)
