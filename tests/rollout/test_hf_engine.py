"""HFEngine: exact behaviour logprobs, interruption by weight updates, versions per token."""

import asyncio

import pytest
import torch

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.rollout.engine import GenerationRequest, InferenceEngine
from areal_ray.rollout.hf_engine import HFEngine


@pytest.fixture()
def engine(random_model_dir):
    torch.manual_seed(0)
    return HFEngine(random_model_dir, max_batch_size=16)


def teacher_forced(engine, reqs, results, temperature):
    seqs = [dict(prompt_ids=q.input_ids, output_ids=r.output_ids, logprobs=r.logprobs,
                 versions=r.versions, advantage=0.0) for q, r in zip(reqs, results)]
    b = pad_batch(seqs, engine.pad_id)
    lp = token_logprobs(engine.model, b["input_ids"], b["attention_mask"], temperature)
    return lp[b["loss_mask"]], b["behavior_logprobs"][b["loss_mask"]]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_a_teacher_forced_pass(engine, temperature):
    reqs = [GenerationRequest([5 + i, 6, 7, 11][: 2 + i % 3], 20, temperature) for i in range(6)]
    res = engine.generate_batch(reqs, version=3)
    tf, beh = teacher_forced(engine, reqs, res, temperature if temperature > 0 else 1.0)
    assert tf.numel() > 0
    assert torch.allclose(tf, beh, atol=1e-4)
    assert all(r.versions == [3] * len(r.output_ids) for r in res)
    assert all(len(r.output_ids) <= 20 and r.stop_reason in ("stop", "length") for r in res)


def test_per_request_budgets_and_ignore_eos(engine):
    reqs = [GenerationRequest([5, 6], n, 1.0, ignore_eos=True) for n in (3, 9, 0)]
    res = engine.generate_batch(reqs, version=0)
    assert [len(r.output_ids) for r in res] == [3, 9, 0]
    assert [r.stop_reason for r in res] == ["length"] * 3


def test_protocol():
    assert isinstance(HFEngine.__new__(HFEngine), InferenceEngine)


def test_weight_update_aborts_in_flight_generation(engine):
    new_state = {k: v + 0.01 for k, v in engine.model.state_dict().items()}

    async def scenario():
        task = asyncio.ensure_future(engine.generate(GenerationRequest([5, 6, 7], 400, 1.0,
                                                                       ignore_eos=True)))
        while engine.load()["running"] == 0:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        info = await engine.update_weights(new_state, version=1)
        return await task, info

    res, info = asyncio.run(scenario())
    assert res.stop_reason == "abort"
    assert 0 < len(res.output_ids) < 400
    assert set(res.versions) == {0}
    assert engine.get_version() == 1 and info["version"] == 1
    assert torch.allclose(engine.model.state_dict()["model.norm.weight"], new_state["model.norm.weight"])


def test_mismatched_weights_are_rejected(engine):
    with pytest.raises(ValueError, match="does not match"):
        engine.load_state_dict({"not.a.weight": torch.zeros(1)})


def test_sampling_is_not_truncated_to_top_k(engine):
    """Behaviour logprobs are of the full softmax, so sampling must not cut to a top-k."""
    req = GenerationRequest([5, 6], 200, 1.0, ignore_eos=True)
    res = engine.generate_batch([req], version=0)[0]
    ids = torch.tensor([req.input_ids + res.output_ids])
    logits = engine.model(input_ids=ids).logits[0, len(req.input_ids) - 1:-1]
    ranks = (logits > logits.gather(-1, ids[0, len(req.input_ids):, None])).sum(-1)
    assert int(ranks.max()) >= 50  # an untruncated near-uniform model samples low-ranked tokens
