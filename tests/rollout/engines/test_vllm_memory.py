"""VLLMEngine's memory release (one GPU shared with the trainer) and its weight staging,
against a strict stand-in for vLLM's `AsyncLLM`: vLLM 0.32 has sleep mode only on GPUs
(CUDA, ROCm, XPU), so the CPU build cannot run it. The stand-in refuses what the real
engine refuses and also what it would silently get wrong: generating while asleep
(vLLM queues the request unserved until a wake), waking what does not sleep (vLLM logs
a warning and wakes nothing), loading into sleeping weights (their device memory is
unmapped), sleeping twice or without sleep mode. On CPUs the engine refuses sleep mode
at construction, as vLLM's own config does."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from areal_ray.rollout.engines import vllm as vllm_engine
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.vllm import SLEEP_TAGS, VLLMEngine
from areal_ray.weights.encoding import digest

vllm = pytest.importorskip("vllm")
from vllm.v1.executor.abstract import SLEEP_TAGS as VLLM_SLEEP_TAGS  # noqa: E402


class StrictAsyncLLM:
    """The part of AsyncLLM's surface VLLMEngine uses. Requests make one token (id 7,
    logprob -1) per millisecond until their budget or an abort."""

    def __init__(self, sleep_mode: bool = True, lora: bool = False):
        self.sleep_mode = sleep_mode
        self.vllm_config = SimpleNamespace(lora_config=object() if lora else None)
        self.loras: set[int] = set()  # adapter ids added
        self.fail_sleep = 0  # sleeps to fail (a CUDA error inside the engine core)
        self.sleeping: set[str] = set()
        self.running: dict[str, asyncio.Event] = {}
        self.calls: list[str] = []
        self.loaded: list[str] = []  # digest of each file loaded
        self.loading = False  # vLLM's engine core runs one such call at a time

    async def generate(self, prompt, sampling_params, request_id, *, prompt_text=None,
                       lora_request=None):
        # AsyncLLM.generate's keyword (vllm/v1/engine/async_llm.py); only LoRA runs set it
        assert lora_request is None or lora_request.lora_int_id in self.loras, \
            "no such adapter was loaded into this engine"
        if self.sleeping:
            raise AssertionError("generate while asleep: vLLM would hold it unserved")
        aborted = self.running[request_id] = asyncio.Event()
        ids = []
        while len(ids) < sampling_params.max_tokens and not aborted.is_set():
            await asyncio.sleep(0.001)
            ids.append(7)
        del self.running[request_id]
        reason = "abort" if aborted.is_set() and len(ids) < sampling_params.max_tokens else "length"
        lps = [{7: SimpleNamespace(logprob=-1.0)} for _ in ids]
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lps,
                                                       finish_reason=reason)])

    async def abort(self, request_id):
        for rid in ([request_id] if isinstance(request_id, str) else request_id):
            if rid in self.running:
                self.running[rid].set()

    async def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.sleep_mode:
            raise AssertionError("sleep without enable_sleep_mode frees nothing")
        if self.sleeping:
            raise AssertionError("sleep while asleep: vLLM warns and does nothing")
        if self.running:
            raise AssertionError("sleep with our requests inside: the gate must drain first")
        if self.loading:
            raise AssertionError("sleep during a weight load")
        assert level == 1
        if self.fail_sleep:
            self.fail_sleep -= 1
            raise RuntimeError("CUDA error: out of memory (offloading the weights)")
        self.sleeping = set(VLLM_SLEEP_TAGS)
        self.calls.append("sleep")

    async def wake_up(self, tags=None):
        tags = sorted(self.sleeping) if tags is None else list(tags)
        if not self.sleeping or any(t not in self.sleeping for t in tags):
            raise AssertionError(f"wake_up({tags}) with {self.sleeping or 'nothing'} asleep: "
                                 "vLLM warns and wakes nothing")
        self.sleeping -= set(tags)
        self.calls.append("wake:" + ",".join(tags))
        return not self.sleeping

    async def add_lora(self, lora_request):
        # the LoRA slots live in the weights' memory pool (model loaded inside it)
        if "weights" in self.sleeping:
            raise AssertionError("add_lora with the weights asleep: their memory is unmapped")
        self.loras.add(lora_request.lora_int_id)
        self.calls.append(f"add_lora:{lora_request.lora_int_id}")
        return True

    async def remove_lora(self, lora_id):
        if "weights" in self.sleeping:
            raise AssertionError("remove_lora with the weights asleep: their memory is unmapped")
        self.calls.append(f"remove_lora:{lora_id}")
        removed = lora_id in self.loras
        self.loras.discard(lora_id)
        return removed

    async def is_sleeping(self):
        return bool(self.sleeping)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if "weights" in self.sleeping:
            raise AssertionError(f"{method} with the weights asleep: their memory is unmapped")
        if method == "areal_load_weights":
            assert not self.running, "a load while requests run"
            from safetensors.torch import load_file
            self.loading = True
            await asyncio.sleep(0.02)  # the load takes a while
            self.loading = False
            self.loaded.append(digest(load_file(args[0])))
            self.calls.append("load")
            return [{"tensors": 1}]
        assert method == "areal_weights_digest"
        return [{"loaded": self.loaded[-1] if self.loaded else None, "readable": {}}]

    async def reset_prefix_cache(self):
        self.calls.append("reset")
        return not self.running  # vLLM refuses while requests run

    async def check_health(self):
        pass

    def shutdown(self):
        pass


def engine(sleep_mode: bool = True, lora: bool = False) -> VLLMEngine:
    eng = VLLMEngine.__new__(VLLMEngine)
    eng._attach(StrictAsyncLLM(sleep_mode, lora), version=0, prefix_caching=True,
                sleep_mode=sleep_mode, record_digest=False)
    eng.model_path, eng.dtype = "some/model", "float32"
    return eng


def request(budget=20_000):
    return GenerationRequest([1, 2, 3], budget, 1.0, ignore_eos=True)


async def until(cond, what, limit_s=30.0):
    t0 = asyncio.get_running_loop().time()
    while not cond():
        assert asyncio.get_running_loop().time() - t0 < limit_s, f"never saw: {what}"
        await asyncio.sleep(0.002)


WEIGHTS = {"w": torch.arange(6.0).reshape(2, 3)}


def test_our_sleep_tags_are_vllms():
    assert set(SLEEP_TAGS) == set(VLLM_SLEEP_TAGS)


def test_release_aborts_sleeps_holds_requests_and_resume_wakes_and_serves_them():
    eng = engine()

    async def scenario():
        running = asyncio.ensure_future(eng.generate(request()))
        await until(lambda: eng.engine.running, "a request running")
        await eng.release_memory()
        aborted = await running
        held = asyncio.ensure_future(eng.generate(request(5)))
        await asyncio.sleep(0.05)
        queued = eng.load()["queued"]
        with pytest.raises(RuntimeError, match="resume_memory"):
            await eng.resume()  # a plain resume would send requests into a sleeping vLLM
        await eng.resume_memory()
        return aborted, queued, await held

    aborted, queued, served = asyncio.run(scenario())
    assert aborted.stop_reason == "abort" and 0 < len(aborted.output_ids) < 20_000
    assert queued == 1 and served.stop_reason == "length" and len(served.output_ids) == 5
    assert eng.engine.calls == ["sleep", "wake:weights,kv_cache"]
    assert not eng.released and eng.load()["paused"] is None


@pytest.mark.parametrize("released,calls_after_push,calls_after_resume", [
    # asleep: the weights wake for the load, the KV cache only when memory comes back;
    # the prefix cache was cleared by the sleep and nothing ran since
    (True, ["sleep", "wake:weights", "load"], ["sleep", "wake:weights", "load", "wake:kv_cache"]),
    (False, ["load", "reset"], ["load", "reset"]),
])
def test_a_push_loads_into_a_running_or_a_sleeping_engine(released, calls_after_push,
                                                          calls_after_resume):
    eng = engine()

    async def scenario():
        if released:
            await eng.release_memory()
        info = await eng.update_weights(WEIGHTS, 1)
        calls = list(eng.engine.calls)
        held = asyncio.ensure_future(eng.generate(request(3)))
        await asyncio.sleep(0.05)
        still_closed = not held.done()
        await eng.resume_memory()  # nothing to do when awake
        return info, calls, still_closed, await held

    info, calls, still_closed, served = asyncio.run(scenario())
    assert calls == calls_after_push and eng.engine.calls == calls_after_resume
    assert still_closed == released  # a push keeps a released engine closed
    assert info["version"] == 1 and served.versions == [1, 1, 1]
    assert eng.engine.loaded == [digest(WEIGHTS)]


@pytest.mark.parametrize("release_first", [True, False])
def test_a_release_racing_a_push_waits_for_the_load(release_first):
    """Either order ends asleep with the pushed weights, and resume_memory wakes what
    sleeps; never a sleep in the middle of a load."""
    eng = engine()

    async def scenario():
        if release_first:  # the push arrives while the engine falls asleep
            release = asyncio.ensure_future(eng.release_memory())
            await asyncio.gather(release, eng.update_weights(WEIGHTS, 1))
        else:  # the release arrives while the load runs
            push = asyncio.ensure_future(eng.update_weights(WEIGHTS, 1))
            await until(lambda: eng.engine.loading, "the load running")
            await asyncio.gather(push, eng.release_memory())
        calls = list(eng.engine.calls)
        await eng.resume_memory()
        return calls

    calls = asyncio.run(scenario())
    assert calls == (["sleep", "wake:weights", "load"] if release_first
                     else ["load", "reset", "sleep"])
    assert not eng.engine.sleeping and eng.get_version() == 1 and eng.gate.is_open


def test_memory_calls_are_idempotent_and_need_sleep_mode():
    eng = engine()

    async def scenario():
        await eng.resume_memory()  # never released: no wake (the stand-in would refuse it)
        await eng.release_memory()
        await eng.release_memory()  # one sleep
        with pytest.raises(RuntimeError, match="asleep"):
            await eng.weights_digest()  # reading unmapped weights would fault
        await eng.resume_memory()
        await eng.resume_memory()  # one wake
        return await eng.weights_digest()

    assert asyncio.run(scenario())["digest"] is None
    assert eng.engine.calls == ["sleep", "wake:weights,kv_cache"]
    plain = engine(sleep_mode=False)
    with pytest.raises(RuntimeError, match="enable_sleep_mode=true"):
        asyncio.run(plain.release_memory())
    assert plain.gate.is_open and plain.engine.calls == []


def test_sleep_mode_is_refused_at_construction_where_vllm_has_none(embedded_model):
    from vllm.platforms import current_platform
    if current_platform.is_sleep_mode_available():
        pytest.skip("this machine's vLLM platform has sleep mode")
    with pytest.raises(ValueError, match="enable_sleep_mode needs a GPU"):
        VLLMEngine(embedded_model, enable_sleep_mode=True)


def test_the_device_to_host_copy_of_a_push_runs_off_the_event_loop(monkeypatch):
    """Copying a model's weights to the host takes about a second per GB: on the event
    loop it would stall every request the replica serves meanwhile."""
    copied_on = []
    real = vllm_engine.distinct_tensors

    def recording(state_dict):
        copied_on.append(threading.get_ident())
        return real(state_dict)

    monkeypatch.setattr(vllm_engine, "distinct_tensors", recording)
    eng = engine()

    async def scenario():
        await eng.update_weights(WEIGHTS, 1)
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert len(copied_on) == 1 and copied_on[0] != loop_thread


def test_the_stand_in_has_the_real_async_llms_surface():
    """Contract: every call VLLMEngine makes on the stand-in exists on vLLM 0.32's
    AsyncLLM with the parameters the stand-in takes, in the same order, and sleep mode
    is an engine argument; so a test passing here calls what the real engine has."""
    import dataclasses
    import inspect

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    def params(fn) -> list[str]:
        return [n for n, p in inspect.signature(fn).parameters.items()
                if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    ours = {n: f for n, f in vars(StrictAsyncLLM).items()
            if callable(f) and not n.startswith("_")}
    assert {"sleep", "wake_up", "generate", "abort"} <= set(ours)
    for name, fn in ours.items():
        real = getattr(AsyncLLM, name, None)
        assert real is not None, f"AsyncLLM has no {name}"
        theirs = params(real)
        assert params(fn) == theirs[:len(params(fn))], (name, params(fn), theirs)
        for kind in (inspect.iscoroutinefunction, inspect.isasyncgenfunction):
            assert kind(fn) == kind(real), (name, kind.__name__)
    assert "enable_sleep_mode" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_a_failed_sleep_is_not_a_release_and_fails_the_replica():
    """R3-M4: a sleep that raised freed nothing known: the engine is not `released`, so
    the next release round sleeps again instead of acking at once beside an awake
    engine, and the health check fails so that Serve replaces the replica."""
    eng = engine()
    eng.engine.fail_sleep = 1

    async def scenario():
        with pytest.raises(RuntimeError, match="out of memory"):
            await eng.release_memory()
        state = (eng.released, set(eng.asleep), eng.load_failure())
        await eng.release_memory()  # the retry sleeps
        return state

    released, asleep, failure = asyncio.run(scenario())
    assert not released and not asleep
    assert failure.startswith("vLLM's sleep (release_memory) failed: RuntimeError")
    assert eng.engine.calls == ["sleep"] and eng.released and eng.asleep == set(SLEEP_TAGS)


def test_an_adapter_removed_while_the_weights_sleep_goes_when_they_wake(monkeypatch, tmp_path):
    """R3-M5: vLLM's LoRA slots sleep with the weights. A remove that reaches a released
    engine waits for their wake (it neither writes into unmapped memory nor wakes the
    weights during the trainer's step)."""
    from areal_ray.weights.adapter import Adapter
    from areal_ray.weights.payloads import AdapterMeta
    monkeypatch.setattr("areal_ray.rollout.engines.adapters.staging_dir", lambda nbytes: tmp_path)
    meta = AdapterMeta("some/model", "", rank=2, alpha=4.0, scaling=2.0, targets=("q_proj",))
    adapter = Adapter(meta, {"model.layers.0.self_attn.q_proj.lora_A": torch.ones(2, 8),
                             "model.layers.0.self_attn.q_proj.lora_B": torch.ones(8, 2)})
    eng = engine(lora=True)

    async def scenario():
        await eng.update_adapter(adapter, 1)
        [lora_id] = eng.slots.loaded
        handle = eng._lora[lora_id]
        await eng.release_memory()
        await eng._remove_lora(lora_id, handle)  # e.g. the last request of an old adapter
        calls_released = list(eng.engine.calls)
        await eng.resume_memory()
        return lora_id, calls_released

    lora_id, calls_released = asyncio.run(scenario())
    assert calls_released == [f"add_lora:{lora_id}", "sleep"]  # nothing woke for the remove
    assert eng.engine.calls[2:] == ["wake:weights,kv_cache", f"remove_lora:{lora_id}"]
    assert eng.engine.loras == set()


def test_the_replicas_cached_cuda_blocks_are_freed_after_each_push(monkeypatch):
    """R3-O2: a push received on the GPU is copied to the host and staged; torch's
    caching allocator would otherwise keep its blocks reserved outside vLLM's share."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    eng = engine()
    asyncio.run(eng.update_weights(WEIGHTS, 1))
    assert len(emptied) == 1 and VLLMEngine.loads_from_host
