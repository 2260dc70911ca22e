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
    engine.version = 3
    res = engine.generate_batch(reqs)
    tf, beh = teacher_forced(engine, reqs, res, temperature if temperature > 0 else 1.0)
    assert tf.numel() > 0
    assert torch.allclose(tf, beh, atol=1e-4)
    assert all(r.versions == [3] * len(r.output_ids) for r in res)
    assert all(len(r.output_ids) <= 20 and r.stop_reason in ("stop", "length") for r in res)


def test_per_request_budgets_and_ignore_eos(engine):
    reqs = [GenerationRequest([5, 6], n, 1.0, ignore_eos=True) for n in (3, 9, 0)]
    res = engine.generate_batch(reqs)
    assert [len(r.output_ids) for r in res] == [3, 9, 0]
    assert [r.stop_reason for r in res] == ["length"] * 3


def test_stop_ids_end_a_request_and_stay_in_its_output(engine):
    """Greedy from a fixed prompt: stopping at the token it emits third ends it there,
    with that token last, under "stop"; the rest of the batch is unaffected."""
    free = engine.generate_batch([GenerationRequest([5, 6], 12, 0.0, ignore_eos=True)])[0]
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    got = engine.generate_batch([GenerationRequest([5, 6], 12, 0.0, ignore_eos=True, stop_ids=[stop]),
                                 GenerationRequest([5, 6], 12, 0.0, ignore_eos=True)])
    assert got[0].output_ids == free.output_ids[:first + 1] and got[0].stop_reason == "stop"
    assert got[1].output_ids == free.output_ids


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
    res = engine.generate_batch([req])[0]
    ids = torch.tensor([req.input_ids + res.output_ids])
    logits = engine.model(input_ids=ids).logits[0, len(req.input_ids) - 1:-1]
    ranks = (logits > logits.gather(-1, ids[0, len(req.input_ids):, None])).sum(-1)
    assert int(ranks.max()) >= 50  # an untruncated near-uniform model samples low-ranked tokens


def long_request(n=300):
    return GenerationRequest([5, 6], n, 1.0, ignore_eos=True)


async def until(cond, what: str, limit_s: float = 60.0):
    """Poll the engine's state (a liveness bound, not a speed assertion)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not cond():
        assert loop.time() - t0 < limit_s, f"never saw: {what}"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_requests_joining_a_running_batch_match_a_teacher_forced_pass(engine, temperature):
    """Joins pad the running cache (a longer prompt) or the new rows (shorter ones), and
    leaving rows trim it; none of that may change a single logprob."""
    late = [GenerationRequest(list(range(4, 4 + n)), 30, temperature, ignore_eos=True)
            for n in (25, 1, 7)]

    async def scenario():
        first = asyncio.ensure_future(engine.generate(long_request(120)))
        await until(lambda: engine.load()["steps"] >= 3, "the first request decoding")
        rest = [asyncio.ensure_future(engine.generate(r)) for r in late]
        return [await first] + [await t for t in rest]

    results = asyncio.run(scenario())
    reqs = [long_request(120)] + late
    assert [len(r.output_ids) for r in results] == [120, 30, 30, 30]
    tf, beh = teacher_forced(engine, reqs, results, 1.0 if temperature == 0 else temperature)
    assert torch.allclose(tf, beh, atol=1e-4)
    if temperature == 0:  # greedy: joining a batch must not change a single token
        alone = [engine.generate_batch([r])[0].output_ids for r in late]
        assert alone == [r.output_ids for r in results[1:]]


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_static_batching_makes_a_short_request_wait_for_the_long_one(random_model_dir, batching):
    engine = HFEngine(random_model_dir, batching=batching)
    finished = []

    async def run(req, name):
        await engine.generate(req)
        finished.append(name)

    async def scenario():
        long = asyncio.ensure_future(run(long_request(300), "long"))
        await until(lambda: engine.load()["running"] == 1, "the long request running")
        await run(GenerationRequest([5, 6, 7], 3, 1.0, ignore_eos=True), "short")
        await long

    asyncio.run(scenario())
    assert finished == (["short", "long"] if batching == "continuous" else ["long", "short"])


def test_wait_mode_update_lets_running_requests_finish_and_holds_new_ones(engine):
    new_state = {k: v * 1.05 for k, v in engine.model.state_dict().items()}

    async def scenario():
        running = asyncio.ensure_future(engine.generate(long_request(150)))
        await until(lambda: engine.load()["running"] == 1, "the request running")
        update = asyncio.ensure_future(engine.update_weights(new_state, 1, mode="wait"))
        await until(lambda: engine.load()["paused"] == "wait", "the engine pausing")
        held = asyncio.ensure_future(engine.generate(GenerationRequest([5], 10, 1.0, ignore_eos=True)))
        info = await update
        return await running, await held, info

    running, held, info = asyncio.run(scenario())
    assert running.stop_reason == "length" and running.versions == [0] * 150
    assert held.versions == [1] * 10
    assert info["version"] == 1 and engine.get_version() == 1


def test_pause_mode_is_checked(engine):
    with pytest.raises(ValueError, match="pause mode"):
        asyncio.run(engine.pause("later"))


def test_a_cancelled_request_leaves_the_batch(engine):
    async def scenario():
        task = asyncio.ensure_future(engine.generate(long_request(100_000)))
        await until(lambda: engine.load()["running"] == 1, "the request running")
        task.cancel()
        await until(lambda: engine.load()["running"] == 0, "the cancelled row retired")
        return engine.load()

    load = asyncio.run(scenario())
    assert load["outstanding_tokens"] == 0 and load["tokens"] < 100_000


def test_the_batch_never_exceeds_max_batch_size(random_model_dir):
    engine = HFEngine(random_model_dir, max_batch_size=3)
    seen = []

    async def scenario():
        tasks = [asyncio.ensure_future(engine.generate(long_request(20 + i))) for i in range(8)]
        while not all(t.done() for t in tasks):
            seen.append(engine.load()["running"])
            await asyncio.sleep(0.001)
        return [t.result() for t in tasks]

    results = asyncio.run(scenario())
    assert [len(r.output_ids) for r in results] == [20 + i for i in range(8)]
    assert max(seen) == 3


def test_released_memory_holds_requests_through_a_push_until_resumed(engine):
    """One GPU shared with the trainer: release aborts what runs (its KV cache goes),
    later requests wait, a push in between loads without reopening, and only
    resume_memory lets them run, on the pushed version."""
    new_state = {k: v * 1.01 for k, v in engine.model.state_dict().items()}

    async def scenario():
        running = asyncio.ensure_future(engine.generate(long_request(100_000)))
        await until(lambda: engine.load()["running"] == 1, "the request running")
        await engine.release_memory()
        aborted = await running
        held = asyncio.ensure_future(engine.generate(GenerationRequest([5], 4, 1.0, ignore_eos=True)))
        with pytest.raises(RuntimeError, match="resume_memory"):
            await engine.resume()
        await engine.update_weights(new_state, 1)
        await asyncio.sleep(0.05)
        waiting = engine.load()
        await engine.resume_memory()
        return aborted, waiting, await held

    aborted, waiting, held = asyncio.run(scenario())
    assert aborted.stop_reason == "abort" and len(aborted.output_ids) < 100_000
    assert (waiting["queued"], waiting["running"], waiting["memory_released"]) == (1, 0, True)
    assert held.versions == [1] * 4 and not engine.load()["memory_released"]


@pytest.mark.parametrize("device,emptied", [("cpu", 0), ("cuda", 1)])
def test_release_hands_cached_blocks_back_to_cuda_only_on_cuda(engine, monkeypatch, device,
                                                               emptied):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    cpu = engine.device
    engine.device = torch.device(device)  # nothing runs while released: no tensor is made
    try:
        asyncio.run(engine.release_memory())
    finally:
        engine.device = cpu
    asyncio.run(engine.resume_memory())
    assert len(calls) == emptied
