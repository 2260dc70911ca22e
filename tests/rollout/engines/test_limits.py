"""RequestLimits (pure), and the rollout replica's generate paths on a real HFEngine
without Serve: a bad request is refused to its own caller before any engine sees it,
while other callers' requests run to their end."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2Config

from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.engines.limits import RequestLimits, RequestRejected
from deployments.rollout import RolloutServer

LIMITS = RequestLimits(vocab_size=10, max_context=8)


def req(ids=(1, 2), n=3, **kw):
    return GenerationRequest(list(ids), n, **kw)


# ----------------------------------------------------------------- pure
@pytest.mark.parametrize("request_,needle", [
    (req(()), "at least one prompt token"),
    (req((1, 10)), "prompt token 1 is id 10, outside the model's vocabulary [0, 10)"),
    (req((-1, 2)), "prompt token 0 is id -1, outside"),
    (req((1, 2.0)), "prompt token 1 must be an integer, got 2.0"),
    (req((1, "2")), "prompt token 1 must be an integer, got '2'"),
    (req((True,)), "prompt token 0 must be an integer, got True"),
    (req(n=-1), "max_new_tokens must be >= 0, got -1"),
    (req(n=2.5), "max_new_tokens must be an integer"),
    (req(range(8)), "the prompt is 8 tokens and the model's context is 8"),
    (req(stop_ids=[3, 12]), "stop id 1 is id 12, outside"),
    (req(seed=-1), "seed must be in [0, 2**63)"),
    (req(seed=2 ** 63), "seed must be in [0, 2**63)"),
    (req(temperature=float("nan")), "temperature must be a finite number"),
    (req(temperature="hot"), "temperature must be a finite number"),
])
def test_a_request_no_engine_can_run_is_refused_naming_the_problem(request_, needle):
    with pytest.raises(RequestRejected) as e:
        LIMITS.admit(request_)
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("request_,ids,budget", [
    (req((1, 2), 3), [1, 2], 3),
    (req((1, 2), 0), [1, 2], 0),
    (req((1, 2), 100), [1, 2], 6),  # cut to the context: ends "length" there
    (req(range(7), 5), list(range(7)), 1),
    (req(np.array([4, 9]), np.int64(2)), [4, 9], 2),  # numpy ints become plain ints
    (req(torch.tensor([4, 9]), 2), [4, 9], 2),
])
def test_an_admitted_request_has_plain_ids_and_a_budget_within_the_context(request_, ids, budget):
    got = LIMITS.admit(request_)
    assert got.input_ids == ids and got.max_new_tokens == budget
    assert all(type(t) is int for t in got.input_ids) and type(got.max_new_tokens) is int
    assert LIMITS.admit(got) == got  # the engine's guard after the replica's check changes nothing


def test_unknown_limits_check_only_the_shape_of_a_request():
    free = RequestLimits(None, None)
    assert free.admit(req((10 ** 9,), 10 ** 6)).max_new_tokens == 10 ** 6
    with pytest.raises(RequestRejected, match="at least one"):
        free.admit(req(()))
    with pytest.raises(RequestRejected, match=r"prompt token 1 is id -1, outside the model's "
                                              r"vocabulary \(ids are >= 0\)"):
        free.admit(req((3, -1)))


def test_a_batch_is_refused_whole_naming_its_bad_request():
    with pytest.raises(RequestRejected, match=r"request 1 of 3: prompt token 0 is id 11"):
        LIMITS.admit_all([req(), req((11,)), req()])
    assert [r.max_new_tokens for r in LIMITS.admit_all([req(n=1), req(n=50)])] == [1, 6]


@pytest.mark.parametrize("max_model_len,context", [(None, 256), (64, 64)])
def test_limits_come_from_the_model_config_or_the_engines_max_model_len(max_model_len, context):
    cfg = Qwen2Config(vocab_size=87, max_position_embeddings=256)
    assert RequestLimits.from_config(cfg, max_model_len) == RequestLimits(87, context)


def test_from_pretrained_reads_the_models_config(random_model_dir):
    limits = RequestLimits.from_pretrained(random_model_dir)
    engine = HFEngine(random_model_dir)
    assert limits == engine.limits == RequestLimits(engine.model.config.vocab_size,
                                                    engine.model.config.max_position_embeddings)


# ----------------------------------------------------------------- the replica
@pytest.fixture()
def replica(random_model_dir):
    torch.manual_seed(0)
    return SimpleNamespace(engine=HFEngine(random_model_dir, max_batch_size=16))


Replica = RolloutServer.func_or_class
GOOD = [[5 + i, 6, 7] for i in range(3)]


def full(ids: list[int], budget: int) -> GenerationRequest:
    """A request that generates its whole budget."""
    return GenerationRequest(ids, budget, 1.0, ignore_eos=True)


async def until_running(engine, n, limit_s=60.0):
    """Until `n` requests run (a liveness bound, not a speed assertion)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while engine.load()["running"] < n:
        assert loop.time() - t0 < limit_s, f"never saw {n} requests running"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("bad_ids", [[5, 10_000], [5, -3]])
def test_a_bad_batch_is_refused_to_its_caller_while_another_callers_batch_completes(replica, bad_ids):
    """Two callers on one replica: the one whose batch holds an id outside the
    vocabulary gets a ValueError naming it, and no request of its batch runs; the
    other's requests, already running, return their whole budget."""
    engine = replica.engine
    engine.version = 4

    async def scenario():
        good = asyncio.ensure_future(Replica.generate_batch(replica, [full(ids, 150) for ids in GOOD]))
        await until_running(engine, len(GOOD))
        prefills = engine.load()["prefills"]
        with pytest.raises(ValueError, match=r"request 1 of 2: prompt token 1 is id -?\d+, outside"):
            await Replica.generate_batch(replica, [full([5, 6], 4), full(bad_ids, 4)])
        assert engine.load()["prefills"] == prefills  # nothing of the refused call reached the engine
        return await good

    results = asyncio.run(scenario())
    assert [len(r["output_ids"]) for r in results] == [150] * 3
    assert all(r["versions"] == [4] * 150 and r["stop_reason"] == "length" for r in results)


def test_a_bad_single_request_is_refused_and_a_long_budget_is_cut_to_the_context(replica):
    engine = replica.engine

    async def scenario():
        good = asyncio.ensure_future(Replica.generate(replica, full([5, 6], 1000)))
        await until_running(engine, 1)
        with pytest.raises(ValueError, match="at least one prompt token"):
            await Replica.generate(replica, GenerationRequest([], 4))
        with pytest.raises(ValueError, match="seed must be"):
            await Replica.generate(replica, GenerationRequest([5], 4, seed=-7))
        return await good

    res = asyncio.run(scenario())
    context = engine.model.config.max_position_embeddings
    assert len(res["output_ids"]) == context - 2 and res["stop_reason"] == "length"


def test_a_batch_whose_request_fails_in_the_engine_cancels_its_other_requests(replica):
    """A request the guard could not know to be bad (here: the guard is told nothing)
    fails in the engine; the call raises at once and its other requests stop running
    instead of generating for a caller that is gone."""
    engine = replica.engine
    engine.limits = RequestLimits(None, None)

    async def scenario():
        with pytest.raises(IndexError):
            await Replica.generate_batch(replica, [full([5, 6], 250), full([5, 10_000], 4)])
        for _ in range(2000):
            if engine.load()["running"] == 0:
                break
            await asyncio.sleep(0.005)
        return engine.load()

    load = asyncio.run(scenario())
    assert load["running"] == 0 and load["tokens"] < 250


def test_anything_but_a_typed_request_is_refused_naming_the_type():
    with pytest.raises(RequestRejected, match="GenerationRequest .* got list"):
        RequestLimits(None, None).admit([5, 6])
