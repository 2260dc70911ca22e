"""HFEngine: exact behaviour logprobs, interruption by weight updates, versions per token."""

import asyncio
import time

import pytest
import torch

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.rollout.engines.base import GenerationRequest, GenerationResult, InferenceEngine
from areal_ray.rollout.engines.hf import HFEngine


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


# ----------------------------------------------------------------- failure isolation
def assert_complete(engine, reqs, results, version):
    """Every request ran to its whole budget, on `version`, with the logprobs a
    teacher-forced pass gives (a failed step left nothing behind in their KV cache)."""
    assert [len(r.output_ids) for r in results] == [q.max_new_tokens for q in reqs]
    assert all(r.stop_reason == "length" and r.versions == [version] * len(r.output_ids)
               for r in results)
    tf, beh = teacher_forced(engine, reqs, results, 1.0)
    assert torch.allclose(tf, beh, atol=1e-4)


GOOD = [GenerationRequest([5 + i, 6, 7], 150, 1.0, ignore_eos=True) for i in range(3)]


@pytest.mark.parametrize("bad,needle", [
    (GenerationRequest([5, 10_000], 8), "prompt token 1 is id 10000, outside the model's vocabulary"),
    (GenerationRequest([5, -1], 8), "prompt token 1 is id -1, outside the model's vocabulary"),
    (GenerationRequest(list(range(3, 60)) * 5, 8), "the prompt is 285 tokens and the model's context is 256"),
    (GenerationRequest([5], -1), "max_new_tokens must be >= 0"),
    (GenerationRequest([5], 8, seed=2 ** 64), "seed must be in"),
])
def test_a_bad_request_is_refused_alone_while_the_running_ones_complete(engine, bad, needle):
    engine.version = 2

    async def scenario():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in GOOD]
        await until(lambda: engine.load()["running"] == len(GOOD), "the good requests running")
        with pytest.raises(ValueError, match=needle):
            await engine.generate(bad)
        return await asyncio.gather(*tasks)

    assert_complete(engine, GOOD, asyncio.run(scenario()), 2)


def test_a_budget_past_the_context_ends_at_the_context(engine):
    context = engine.model.config.max_position_embeddings
    (res,) = engine.generate_batch([GenerationRequest([5, 6, 7], 10 * context, 1.0, ignore_eos=True)])
    assert len(res.output_ids) == context - 3 and res.stop_reason == "length"


async def together(engine, reqs):
    """Generate `reqs` admitted in one go (queued behind a pause): one prefill chunk,
    one cohort, except in invariant batching. Results or exceptions, in order."""
    await engine.pause("wait")
    tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
    await until(lambda: engine.load()["queued"] == len(reqs), "the requests queued")
    await engine.resume()
    return await asyncio.gather(*tasks, return_exceptions=True)


def unguarded(engine):
    """As if the guard missed what is wrong with a request: the engine admits any id."""
    from areal_ray.rollout.engines.limits import RequestLimits
    engine.limits = RequestLimits(None, None)
    return engine


@pytest.mark.parametrize("batching", ["continuous", "static", "invariant"])
def test_a_request_failing_in_a_shared_prefill_fails_alone(random_model_dir, batching):
    """Prefilled in one chunk with good requests, a request whose forward fails (an id
    past the embedding table) fails by itself: the chunk is retried row by row."""
    torch.manual_seed(0)
    engine = unguarded(HFEngine(random_model_dir, max_batch_size=16, batching=batching))
    bad = GenerationRequest([5, 10_000, 6], 8, 1.0)
    good0, err, *rest = asyncio.run(together(engine, [GOOD[0], bad, *GOOD[1:]]))
    assert isinstance(err, IndexError)
    assert_complete(engine, GOOD, [good0, *rest], 0)
    load = engine.load()
    assert load["running"] == 0 and load["failed_requests"] == 1
    assert load["isolated_steps"] == (batching != "invariant")  # invariant: alone already


def fail_past_position(engine, limit):
    """The last decoder layer raises once a row's position reaches `limit`, as a model
    with a position table of `limit` entries would: mid-forward, after the earlier
    layers have appended the step to the KV cache."""
    seen = {}

    def positions(module, args, kwargs):  # the engine's calls give positions; others start at 0
        ids = kwargs.get("position_ids")
        seen["max"] = -1 if ids is None else int(ids.max())

    def layer(module, args, kwargs):
        if seen["max"] >= limit:
            raise IndexError(f"position {seen['max']} is past the position table ({limit})")

    engine.model.register_forward_pre_hook(positions, with_kwargs=True)
    engine.model.model.layers[-1].register_forward_pre_hook(layer, with_kwargs=True)


@pytest.mark.parametrize("batching", ["continuous", "static", "invariant"])
def test_a_request_failing_mid_decode_fails_alone_and_the_others_complete(random_model_dir, batching):
    """A long prompt decoding in one cohort with short ones reaches a position its
    model cannot take: that request fails alone, with its own error; the step is
    rolled back and retried row by row, and the others generate their whole budget
    with exact logprobs."""
    torch.manual_seed(0)
    engine = unguarded(HFEngine(random_model_dir, max_batch_size=16, batching=batching))
    engine.version = 5
    fail_past_position(engine, 60)
    good = [GenerationRequest([5 + i, 6, 7], 50, 1.0, ignore_eos=True) for i in range(3)]
    bad = GenerationRequest(list(range(3, 58)), 30, 1.0, ignore_eos=True)  # fails at its 7th token
    good0, err, *rest = asyncio.run(together(engine, [good[0], bad, *good[1:]]))
    assert isinstance(err, IndexError) and "position 60" in str(err)
    assert_complete(engine, good, [good0, *rest], 5)
    load = engine.load()
    assert load["failed_requests"] == 1
    assert load["isolated_steps"] == (batching != "invariant")  # invariant: alone already
    later = engine.generate_batch([GenerationRequest([5, 6], 10, 1.0, ignore_eos=True)])
    assert [len(r.output_ids) for r in later] == [10]


@pytest.mark.parametrize("ids", [[5, 6], [5, 10_000, 6]], ids=["finished", "failed"])
def test_a_request_is_not_running_once_its_caller_has_it(random_model_dir, monkeypatch, ids):
    """`load` is read from other threads than the scheduler's (the replica's reports, a
    test's check): a row leaves the running set before its caller is handed the result
    or the error, however long the scheduler thread is held up right after."""
    from areal_ray.rollout.engines import hf
    resolve = hf._Row.resolve

    def held_up(self, *args, **kwargs):
        resolve(self, *args, **kwargs)
        time.sleep(0.3)  # the scheduler thread, preempted just after handing the result over

    monkeypatch.setattr(hf._Row, "resolve", held_up)
    engine = unguarded(HFEngine(random_model_dir, max_batch_size=4, batching="invariant"))

    async def run():
        done = await asyncio.gather(engine.generate(GenerationRequest(ids, 4, 1.0)),
                                    return_exceptions=True)
        return done[0], engine.load()["running"]

    result, running = asyncio.run(run())
    assert isinstance(result, IndexError if 10_000 in ids else GenerationResult)
    assert running == 0
