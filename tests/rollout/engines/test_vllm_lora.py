"""VLLMEngine serves pushed LoRA adapters through vLLM's own LoRA support (vllm_lora.py),
on the real CPU build and the embedded tiny model.

Pure parts first (vLLM's rank table, the adapter-id bookkeeping, the peft directory,
read back by peft and by vLLM's own reader); then one real engine with LoRA enabled:
two pushed adapters each change the outputs and match the merged model's teacher-forced
logprobs (vLLM's LoRA kernels add the low-rank term apart from the base matmul, so not
bit for bit: the bound is measured), each version gets a new adapter id and the old
one is unloaded, a request in flight across a push keeps exact per-token versions
(resumed under the new adapter; or, with rollout.lora_push=finish, run to its end
under the adapter it started with beside requests under newer ones, with no prefix
reused across adapters), an adapter of another base is refused with the served one
untouched, and a full push takes the engine back to plain weights.
"""

import asyncio
import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.rollout.engines.adapters import (
    AdapterSlots,
    lora_slots,
    peft_adapter_config,
    write_peft_dir,
)
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.vllm import VLLMEngine, engine_args
from areal_ray.rollout.engines.vllm_lora import lora_engine_args, max_lora_rank
from areal_ray.rollout.interruptible import generate_interruptible
from areal_ray.weights.adapter import Adapter, base_digest, merged_state
from areal_ray.weights.payloads import AdapterMeta

vllm = pytest.importorskip("vllm")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 8, 16.0
PROMPT = list(range(3, 43))  # longer than a KV block: the prefix cache applies


def make_adapter(model, seed: int, scale: float = 0.05, base: str = "tiny") -> Adapter:
    """A rank-8 adapter of every target of `model`, as a trainer would push one (random
    nonzero A and B, so it moves the outputs), with the meta of `model`'s base."""
    g = torch.Generator().manual_seed(seed)
    mods = {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGETS}
    tensors = {}
    for n, m in mods.items():
        tensors[f"{n}.lora_A"] = torch.randn(RANK, m.in_features, generator=g) * scale
        tensors[f"{n}.lora_B"] = torch.randn(m.out_features, RANK, generator=g) * scale
    digest = base_digest({n: m.weight.detach() for n, m in mods.items()}, "float32")
    return Adapter(AdapterMeta(base, digest, RANK, ALPHA, ALPHA / RANK, TARGETS), tensors)


# ----------------------------------------------------------------- pure parts
@pytest.mark.parametrize("rank,want", [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320),
                                       (512, 512)])
def test_max_lora_rank_is_the_smallest_vllm_takes(rank, want):
    assert max_lora_rank(rank) == want


def test_a_rank_past_vllms_table_is_refused():
    with pytest.raises(ValueError, match="model.lora.rank=513 is above vLLM's largest"):
        max_lora_rank(513)


def test_engine_args_enable_lora_only_when_asked():
    assert lora_engine_args(0) == {}
    args = engine_args("m", dtype="float32", max_batch_size=4, kv_cache_mb=64, enforce_eager=True,
                       prefix_caching=True, seed=None, extra={}, lora_rank=4)
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 8, 2)
    vllm.engine.arg_utils.AsyncEngineArgs(**args)  # every key is one of vLLM's
    # rollout.lora_push=finish: the versions of eta + 1 steps, and the next one
    assert lora_slots(eta=2, finish=True) == 4 and lora_slots(eta=2, finish=False) == 2
    assert lora_engine_args(4, 4)["max_cpu_loras"] == 4


# (step, expected unused ids after it): the adapter-id life of a push sequence
SLOTS = [
    ("new", []),         # id 1 added ahead of its swap: pending, not unloadable
    ("activate 1", []),
    ("acquire", []),     # a request runs under 1
    ("new", []),         # id 2 pending
    ("activate 2", []),  # 1 still has a running request
    ("release 1", [1]),  # its last request ended: unload 1
    ("unloaded 1", []),
    ("activate None", [2]),  # a full push: no adapter serves, 2 has no users
]


def test_adapter_slots_unload_an_id_once_no_request_uses_it():
    slots = AdapterSlots()
    for step, want in SLOTS:
        op, _, arg = step.partition(" ")
        if op == "new":
            slots.new_id()
        elif op == "activate":
            slots.activate(None if arg == "None" else int(arg))
        elif op == "acquire":
            assert slots.acquire() == slots.current
        elif op == "release":
            slots.release(int(arg))
        elif op == "unloaded":
            slots.unloaded(int(arg))
        assert slots.unused() == want, step
    assert slots.new_id() == 3  # ids are never reused


def test_adapter_slots_refuse_what_would_corrupt_the_count():
    slots = AdapterSlots()
    with pytest.raises(ValueError, match="adapter id 5 is not loaded"):
        slots.activate(5)
    slots.activate(slots.new_id())
    with pytest.raises(ValueError, match="released more often than acquired"):
        slots.release(1)
    assert slots.acquire() == 1
    assert AdapterSlots().acquire() is None  # the base serves: nothing to count


@pytest.fixture(scope="module")
def hf_model(embedded_model):
    return AutoModelForCausalLM.from_pretrained(embedded_model).eval()


def test_the_adapter_directory_is_peft_format(hf_model, tmp_path):
    """peft loads it onto the base and merges to the weights our merge computes, and
    vLLM's own reader takes its config with the adapter's scaling."""
    import copy

    import peft
    from vllm.lora.peft_helper import PEFTHelper
    adapter = make_adapter(hf_model, seed=1)
    path = write_peft_dir(adapter, tmp_path / "v1")
    assert json.loads((path / "adapter_config.json").read_text()) == peft_adapter_config(adapter)
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), str(path)).merge_and_unload()
    want = merged_state(hf_model.state_dict(), adapter)
    got = merged.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    helper = PEFTHelper.from_local_dir(str(path), max_position_embeddings=256)
    assert (helper.r, helper.vllm_lora_scaling_factor) == (RANK, ALPHA / RANK)


# ----------------------------------------------------------------- the real engine
@pytest.fixture(scope="module")
def vllm_lora_engine(embedded_model):
    """The real engine with LoRA slots (engine tier: ENGINE_FIXTURES in tests/conftest.py)."""
    # 3 slots: a finish push has requests under two adapters and the next one added
    eng = VLLMEngine(embedded_model, max_batch_size=8, kv_cache_mb=64, lora_rank=RANK,
                     lora_slots=3)
    yield eng
    eng.shutdown()


_LOOP = asyncio.new_event_loop()


def run(coro):
    return _LOOP.run_until_complete(coro)  # AsyncLLM binds to the loop of its first call


def teacher_forced(model, prompt, out) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(out)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


# vLLM's LoRA term (punica's CPU ops: x @ A then @ B * scaling, added to the base GEMM
# in float32) against the trainer's merged weight W + (B @ A) * scaling: the same
# function, other rounding. Measured max |diff| of 48 logprobs: ~2e-5 (float32).
LORA_ATOL = 2e-4


def test_each_pushed_adapter_is_served_under_a_new_id_and_matches_the_merged_model(
        vllm_lora_engine, hf_model):
    engine = vllm_lora_engine
    base = {k: v.clone() for k, v in hf_model.state_dict().items()}
    req = GenerationRequest(PROMPT, 48, 1.0, ignore_eos=True, seed=7)
    before = run(engine.generate(req))
    assert before.versions == [0] * 48
    outputs, diffs = [before.output_ids], []
    for version in (1, 2):
        adapter = make_adapter(hf_model, seed=version)
        info = run(engine.update_adapter(adapter, version))
        assert info["adapter_modules"] == 21 and engine.version == version
        print(f"v{version}: {info['adapter_bytes']} B written in {info['adapter_write_s']:.4f} s, "
              f"added in {info['adapter_add_s']:.4f} s, swap {info['load_s']:.4f} s")
        assert engine.adapters() == {"current": version, "loaded": [version], "users": {}}
        res = run(engine.generate(req))
        assert res.versions == [version] * 48
        outputs.append(res.output_ids)
        model = AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
        model.load_state_dict(merged_state(base, adapter))
        diff = (torch.tensor(res.logprobs) - teacher_forced(model, PROMPT, res.output_ids)).abs()
        diffs.append(float(diff.max()))
        # ... and not the base's, nor the previous adapter's (no stacking, no stale KV)
        stale = teacher_forced(hf_model, PROMPT, res.output_ids)
        assert (torch.tensor(res.logprobs) - stale).abs().max() > 100 * LORA_ATOL
    print(f"vLLM LoRA vs merged model, max |logprob diff| per version: {diffs}")
    assert max(diffs) < LORA_ATOL
    assert outputs[0] != outputs[1] != outputs[2]  # same seed: the adapters moved the samples


def test_the_load_probe_of_an_adapter_matches_the_trainers_within_vllms_tolerance(
        vllm_lora_engine, hf_model):
    """weights/probe.py: what the replica scores after a push against the trainer's own
    forward of the merged model; the base's probe is far outside the tolerance."""
    import time

    from areal_ray.train.probe import model_probe
    from areal_ray.weights.probe import probe_atol, probe_ids
    engine = vllm_lora_engine
    adapter = make_adapter(hf_model, seed=20)
    engine.probe_ids = probe_ids(engine.limits.vocab_size)  # as the replica sets it
    try:
        info = run(engine.update_adapter(adapter, engine.version + 1))
    finally:
        engine.probe_ids = None
    trainer = AutoModelForCausalLM.from_pretrained(engine.model_path)
    trainer.load_state_dict(merged_state(hf_model.state_dict(), adapter))
    ids, want = model_probe(trainer)
    assert ids == probe_ids(engine.limits.vocab_size)
    in_swap = run(engine.score(ids))  # scored inside the swap, before the gate reopened
    engine._probe = None
    t0 = time.perf_counter()
    gated = run(engine.score(ids))  # a request through the gate, as any other
    probe_s = time.perf_counter() - t0
    assert in_swap == gated
    diff = max(abs(a - b) for a, b in zip(gated, want))
    _, base = model_probe(hf_model)
    signal = max(abs(a - b) for a, b in zip(base, want))
    print(f"vLLM probe: max |diff| {diff:.3g} (signal {signal:.3g}); {probe_s * 1e3:.1f} ms "
          f"through the gate, swap with the probe inside {info['load_s'] * 1e3:.1f} ms")
    assert diff < probe_atol("vllm") < signal


def test_a_request_in_flight_keeps_exact_versions_across_an_adapter_push(vllm_lora_engine,
                                                                       hf_model):
    engine = vllm_lora_engine

    async def gen(ids, n, temperature):
        res = await engine.generate(GenerationRequest(ids, n, temperature, ignore_eos=True))
        return res.to_dict()

    async def scenario(adapter, version, delay_s):
        task = asyncio.ensure_future(generate_interruptible(gen, PROMPT, 200, 1.0))
        while engine.load()["running"] == 0:
            await asyncio.sleep(0.005)
        await asyncio.sleep(delay_s)
        await engine.update_adapter(adapter, version)
        return await task

    # The push must land after the first tokens: on a busy machine vLLM's first step
    # may not have run yet, so a push that came too early (every token at the new
    # version, also exact) is tried again a little later.
    old = make_adapter(hf_model, seed=30)
    run(engine.update_adapter(old, engine.version + 1))
    for delay_s in (0.05, 0.3, 1.0, 3.0):
        start = engine.version
        adapter = make_adapter(hf_model, seed=31 + start)
        sample = run(scenario(adapter, start + 1, delay_s))
        assert len(sample.output_ids) == 200 and sample.n_resubmits >= 1
        k = sample.versions.index(start + 1)
        assert sample.versions == [start] * k + [start + 1] * (200 - k)
        if k > 0:
            break
        old = adapter
    assert k > 0
    # the resumed tokens' logprobs are the new adapter's (KV recomputed under it)
    def under(a: Adapter) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
        model.load_state_dict(merged_state(hf_model.state_dict(), a))
        return teacher_forced(model, PROMPT, sample.output_ids)
    beh = torch.tensor(sample.logprobs)
    assert (under(adapter)[k:] - beh[k:]).abs().max() < LORA_ATOL
    assert (under(old)[:k] - beh[:k]).abs().max() < LORA_ATOL  # earlier tokens: the old version's
    assert engine.adapters()["loaded"] == [engine.adapters()["current"]]  # the old id is gone


def merged_model(engine, hf_model, a: Adapter):
    model = AutoModelForCausalLM.from_pretrained(engine.model_path).eval()
    model.load_state_dict(merged_state(hf_model.state_dict(), a))
    return model


def test_with_finish_a_request_in_flight_ends_under_the_adapter_it_started_with(
        vllm_lora_engine, hf_model):
    """rollout.lora_push=finish: the push aborts nothing; the running request's every
    token is the old version's, computed by the old adapter, while a request admitted
    after the push (same prompt: its blocks were cached under the old adapter) is the
    new adapter's from its first token; the old id goes once its last request ends."""
    engine = vllm_lora_engine
    old, new = make_adapter(hf_model, seed=40), make_adapter(hf_model, seed=41)
    run(engine.update_adapter(old, engine.version + 1))
    start, old_id = engine.version, engine.adapters()["current"]

    async def gen(ids, n, temperature):
        res = await engine.generate(GenerationRequest(ids, n, temperature, ignore_eos=True))
        return res.to_dict()

    async def scenario():
        task = asyncio.ensure_future(generate_interruptible(gen, PROMPT, 200, 1.0))
        while engine.load()["running"] == 0:
            await asyncio.sleep(0.005)
        await engine.update_adapter(new, start + 1, "finish")
        during = engine.adapters()
        fresh = await engine.generate(GenerationRequest(PROMPT, 24, 1.0, ignore_eos=True))
        return await task, during, fresh

    sample, during, fresh = run(scenario())
    new_id = during["current"]
    assert new_id != old_id and during["users"] == {old_id: 1}  # still running after the push
    assert sample.n_resubmits == 0 and sample.versions == [start] * 200
    beh = torch.tensor(sample.logprobs)
    assert (teacher_forced(merged_model(engine, hf_model, old), PROMPT, sample.output_ids)
            - beh).abs().max() < LORA_ATOL
    assert fresh.versions == [start + 1] * 24
    want = teacher_forced(merged_model(engine, hf_model, new), PROMPT, fresh.output_ids)
    assert (want - torch.tensor(fresh.logprobs)).abs().max() < LORA_ATOL
    assert engine.adapters() == {"current": new_id, "loaded": [new_id], "users": {}}


def test_an_adapter_of_another_base_is_refused_and_the_served_one_stays(vllm_lora_engine,
                                                                        hf_model):
    engine = vllm_lora_engine
    engine._base_checked = False  # the check runs on the first adapter of an engine
    served, version = engine.adapters(), engine.version
    bad = make_adapter(hf_model, seed=3)
    bad = Adapter(dataclasses.replace(bad.meta, base_digest="0" * 64), bad.tensors)
    with pytest.raises(ValueError, match="other weights than this engine serves"):
        run(engine.update_adapter(bad, version + 1))
    assert engine.adapters() == served and engine.version == version and engine.gate.is_open


def test_a_full_push_serves_plain_weights_and_unloads_the_adapter(vllm_lora_engine, hf_model):
    engine = vllm_lora_engine
    assert engine.adapters()["current"] is not None
    version = engine.version + 1
    run(engine.update_weights({k: v.clone() for k, v in hf_model.state_dict().items()}, version))
    assert engine.adapters() == {"current": None, "loaded": [], "users": {}}
    res = run(engine.generate(GenerationRequest(PROMPT, 16, 1.0, ignore_eos=True)))
    tf = teacher_forced(hf_model, PROMPT, res.output_ids)
    assert res.versions == [version] * 16 and (tf - torch.tensor(res.logprobs)).abs().max() < 1e-4
