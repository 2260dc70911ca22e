"""HFEngine with per-request seeds: seeded draws that never depend on other rows, and
`batching="invariant"`, where a seeded request's tokens AND logprobs are bit-identical
alone, among other traffic arriving at any time, and across an abort + resubmission.
Exact comparisons throughout (==, not allclose): that is the claim."""

import asyncio
import copy

import pytest
import torch

from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine, _Row
from tests.rollout.engines.test_hf import until


def make(model_dir, batching="invariant", **kw):
    return HFEngine(model_dir, max_batch_size=16, batching=batching, **kw)


def req(prompt_len, budget, temperature=1.0, seed=None, start=5):
    return GenerationRequest([start + (i * 7) % 60 for i in range(prompt_len)], budget, temperature,
                             ignore_eos=True, seed=seed)


# Seeded requests of several prompt lengths and temperatures (greedy included).
TARGETS = [req(3, 40, 1.0, seed=11), req(17, 30, 0.7, seed=12), req(8, 35, 1.3, seed=13),
           req(30, 25, 0.0, seed=None), req(1, 30, 1.0, seed=2**62 + 5)]


def noise(i):
    """Other traffic: unseeded and seeded, prompts of 1-45 tokens, budgets of 5-80."""
    return req(1 + (i * 11) % 45, 5 + (i * 29) % 76, [1.0, 0.5, 0.0][i % 3],
               seed=None if i % 2 else 1000 + i, start=4 + i)


def key(res):
    return (res.output_ids, res.logprobs, res.stop_reason)


def alone(model_dir, reqs, batching="invariant"):
    eng = make(model_dir, batching)
    try:
        return [key(eng.generate_batch([r])[0]) for r in reqs]
    finally:
        eng.shutdown()


# ----------------------------------------------------------------- seeded draws
def _rows(reqs):
    loop = asyncio.new_event_loop()
    return [_Row(r, loop, loop.create_future()) for r in reqs]


def test_a_seeded_draw_does_not_depend_on_the_other_rows(random_model_dir):
    """`_record` on fixed logits: the seeded row's tokens are the same alone and next to
    any other rows (seeded, unseeded, greedy), and another seed gives other tokens."""
    eng = make(random_model_dir, "continuous")
    torch.manual_seed(0)
    logits = torch.randn(6, 50)

    def draws(reqs, row_logits, steps=40, at=0):
        rows = _rows(reqs)
        for _ in range(steps):
            eng._record(rows, row_logits)
        return rows[at].out, rows[at].logprobs

    target = GenerationRequest([1], 40, 0.8, seed=7)
    ref = draws([target], logits[:1])
    others = [GenerationRequest([1], 40, 1.0), GenerationRequest([1], 40, 0.0),
              GenerationRequest([1], 40, 1.0, seed=8), GenerationRequest([1], 40, 0.5)]
    for k in range(1, 5):
        mixed = draws(others[:k] + [target], torch.cat([logits[1:k + 1], logits[:1]]), at=k)
        assert mixed == ref
    assert draws([GenerationRequest([1], 40, 0.8, seed=8)], logits[:1])[0] != ref[0]


def test_unseeded_sampling_still_uses_the_global_generator(random_model_dir):
    eng = make(random_model_dir, "continuous")
    r = GenerationRequest([5, 6], 30, 1.0, ignore_eos=True)
    torch.manual_seed(3)
    a = eng.generate_batch([r])[0].output_ids
    torch.manual_seed(3)
    assert eng.generate_batch([r])[0].output_ids == a


@pytest.mark.parametrize("batching", ["continuous", "invariant"])
def test_the_seed_decides_the_sample(random_model_dir, batching):
    eng = make(random_model_dir, batching)
    r = req(4, 60, 1.0, seed=5)
    torch.manual_seed(0)
    first = key(eng.generate_batch([r])[0])
    torch.manual_seed(1)  # the global generator does not matter for a seeded request
    assert key(eng.generate_batch([r])[0]) == first
    other = eng.generate_batch([req(4, 60, 1.0, seed=6)])[0]
    assert other.output_ids != first[0]


# ----------------------------------------------------------------- invariant batching
@pytest.fixture(params=["random_model_dir", "embedded_model"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def test_invariant_rows_are_bit_identical_among_traffic_arriving_at_any_time(model_dir):
    """(a) each target alone vs (b) all targets mixed with 12 other requests of other
    lengths, submitted before, together with and while the targets decode."""
    ref = alone(model_dir, TARGETS)
    eng = make(model_dir)

    async def scenario():
        early = [asyncio.ensure_future(eng.generate(noise(i))) for i in range(4)]
        await until(lambda: eng.load()["steps"] >= 3, "the first requests decoding")
        targets = []
        for j, t in enumerate(TARGETS):  # each target arrives at its own time
            targets.append(asyncio.ensure_future(eng.generate(t)))
            late = [asyncio.ensure_future(eng.generate(noise(4 + 2 * j + k))) for k in range(2)]
            steps = eng.load()["steps"]
            await until(lambda steps=steps, j=j: eng.load()["steps"] >= steps + 2 + j, "decoding on")
            early += late
        got = [await t for t in targets]
        await asyncio.gather(*early)
        return got

    got = asyncio.run(scenario())
    assert eng.load()["prefills"] == len(TARGETS) + 4 + 2 * len(TARGETS)  # one per request
    assert [key(r) for r in got] == ref


def test_continuous_batching_is_not_invariant(model_dir):
    """Why the mode exists: next to a longer prompt a row is left-padded, and its
    logprobs move in the last bits (its greedy tokens need not move)."""
    t = req(10, 20, 0.0)
    ref = alone(model_dir, [t], "continuous")[0]
    eng = make(model_dir, "continuous")  # neighbours close enough in length to be merged
    padded = eng.generate_batch([t, req(12, 20, 0.0), req(15, 20, 0.0)])[0]
    assert padded.output_ids == ref[0]
    diff = (torch.tensor(padded.logprobs) - torch.tensor(ref[1])).abs().max().item()
    assert 0 < diff < 1e-4


def test_invariant_resubmission_after_an_abort_is_bit_identical(model_dir):
    """(c) a target aborted by a weight push amid traffic, resubmitted as prompt +
    partial output with a new seed amid more traffic, vs the same cut made without any
    other traffic: the partial output, then the continuation, bit for bit."""
    target = req(6, 200, 1.0, seed=21)
    eng = make(model_dir)
    new_state = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
                 for k, v in copy.deepcopy(eng.model.state_dict()).items()}

    async def mixed():
        others = [asyncio.ensure_future(eng.generate(noise(i))) for i in range(5)]
        task = asyncio.ensure_future(eng.generate(target))
        await until(lambda: eng.load()["steps"] >= 12, "the target decoding")
        await eng.update_weights(new_state, version=1, mode="abort")
        part = await task
        prefix = target.input_ids + part.output_ids
        resub = GenerationRequest(prefix, 200 - len(part.output_ids), 1.0, ignore_eos=True, seed=22)
        more = [asyncio.ensure_future(eng.generate(noise(10 + i))) for i in range(5)]
        rest = await eng.generate(resub)
        await asyncio.gather(*others, *more, return_exceptions=True)
        return part, resub, rest

    part, resub, rest = asyncio.run(mixed())
    k = len(part.output_ids)
    assert part.stop_reason == "abort" and 0 < k < 200 and set(part.versions) == {0}

    quiet = make(model_dir)  # the same cut, nothing else running
    cut = GenerationRequest(target.input_ids, k, 1.0, ignore_eos=True, seed=21)
    first = quiet.generate_batch([cut])[0]
    asyncio.run(quiet.update_weights(new_state, version=1, mode="abort"))
    second = quiet.generate_batch([resub])[0]
    assert (first.output_ids, first.logprobs) == (part.output_ids, part.logprobs)
    assert (second.output_ids, second.logprobs, second.versions) == \
        (rest.output_ids, rest.logprobs, rest.versions)
    assert rest.versions == [1] * (200 - k)
