"""SGLangEngine on CPU: request/response shaping, and the pause/version/weight-session logic
against a strict fake sglang engine (sglang itself needs GPUs; tests/contract/ checks our
calls against the real wheel).

The fake outputs are shaped like sglang's (sgl-project/sglang @ 001067ff):
python/sglang/srt/managers/tokenizer_manager.py, TokenizerManager._handle_batch_output,
builds {"output_ids", "meta_info"} for skip_tokenizer_init (its BatchTokenIDOutput
branch); meta_info["finish_reason"] is the scheduler's FINISH_*.to_json() from
managers/schedule_batch.py ({"type": "stop", "matched": id}, {"type": "length",
"length": n}, {"type": "abort", "message", "status_code", "err_type"});
meta_info["output_token_logprobs"] comes from detokenize_logprob_tokens, (logprob,
token_id, None) tuples when no text is decoded; _handle_abort_req answers a request
aborted in the waiting queue with {"text": "", "output_ids": [], ...} and finish_reason
{"type": "abort", "message": "Abort in waiting queue"}.
"""

import asyncio
import os
from types import SimpleNamespace

import pytest
import torch

from areal_ray.rollout.engines import sglang as se
from areal_ray.rollout.engines.base import GenerationRequest, InferenceEngine
from areal_ray.rollout.engines.sglang import (
    SGLangEngine,
    named_tensors,
    original_logprob_env,
    parse_output,
    sampling_params,
)


def sglang_out(ids, finish, lps=None, rid="r"):
    lps = lps if lps is not None else [-0.25 * (i + 1) for i in range(len(ids))]
    return {"output_ids": list(ids), "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": 3, "weight_version": "default",
        "num_retractions": 0, "input_token_logprobs": [],
        "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, ids)],
        "output_token_logprobs_length": len(ids), "reasoning_tokens": 0,
        "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": 0.01}}


STOP = {"type": "stop", "matched": 2}
ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


# ----------------------------------------------------------------- pure shaping
def test_sampling_params_sampled_use_the_full_distribution():
    p = sampling_params(GenerationRequest([1, 2], 16, temperature=0.7))
    assert p == {"max_new_tokens": 16, "ignore_eos": False, "temperature": 0.7, "top_k": -1,
                 "top_p": 1.0, "min_p": 0.0}


def test_a_request_seed_is_sglangs_sampling_seed():
    p = sampling_params(GenerationRequest([1, 2], 16, temperature=0.7, seed=123))
    assert p["sampling_seed"] == 123 and p["temperature"] == 0.7
    assert "sampling_seed" not in sampling_params(GenerationRequest([1, 2], 16, temperature=0.7))


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_sampling_params_greedy(temperature):
    p = sampling_params(GenerationRequest([1], 4, temperature=temperature, ignore_eos=True))
    assert (p["temperature"], p["top_k"], p["ignore_eos"], p["max_new_tokens"]) == (0.0, 1, True, 4)


def test_parse_stop_length_and_abort():
    r = parse_output(sglang_out([7, 8, 2], STOP, [-0.1, -0.2, -0.3]), version=5, budget=10, rid="a")
    assert (r.output_ids, r.logprobs, r.versions, r.stop_reason, r.rid) == (
        [7, 8, 2], [-0.1, -0.2, -0.3], [5, 5, 5], "stop", "a")
    assert r.meta["finish_reason"] == STOP
    r = parse_output(sglang_out([7, 8], {"type": "length", "length": 2}), 1, budget=2)
    assert r.stop_reason == "length" and r.versions == [1, 1]
    r = parse_output(sglang_out([7, 8], ABORT), 1, budget=9)
    assert r.stop_reason == "abort" and r.output_ids == [7, 8] and len(r.logprobs) == 2


def test_parse_abort_in_waiting_queue_is_empty():
    out = {"text": "", "output_ids": [], "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default", "e2e_latency": 0.0, "input_token_logprobs": [],
        "output_token_logprobs": [], "output_token_logprobs_length": 0, "completion_tokens": 0}}
    r = parse_output(out, 3, budget=8)
    assert (r.output_ids, r.logprobs, r.versions, r.stop_reason) == ([], [], [], "abort")


@pytest.mark.parametrize("finish", [STOP, ABORT])
def test_a_result_that_used_its_whole_budget_is_length(finish):
    assert parse_output(sglang_out([4, 5, 2], finish), 0, budget=3).stop_reason == "length"


@pytest.mark.parametrize("finish", [{"type": "eos"}, None, "stop"])
def test_unknown_finish_reason_raises(finish):
    with pytest.raises(ValueError, match="unknown finish reason"):
        parse_output(sglang_out([4], finish), 0, budget=3)


def test_misaligned_or_oversized_outputs_raise():
    out = sglang_out([4, 5], STOP)
    out["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(ValueError, match="do not match"):
        parse_output(out, 0, budget=5)
    out = sglang_out([4, 5], STOP)
    out["output_ids"][1] = 9
    with pytest.raises(ValueError, match="do not match"):
        parse_output(out, 0, budget=5)
    with pytest.raises(ValueError, match="budget"):
        parse_output(sglang_out([4, 5, 6], STOP), 0, budget=2)


def test_named_tensors_keep_order_and_cast():
    sd = {"b.weight": torch.ones(2, 3), "a.bias": torch.zeros(3, requires_grad=True)}
    pairs = named_tensors(sd)
    assert [n for n, _ in pairs] == ["b.weight", "a.bias"]
    assert pairs[0][1].dtype == torch.float32 and not pairs[1][1].requires_grad
    assert all(t.dtype == torch.bfloat16 for _, t in named_tensors(sd, torch.bfloat16))


def test_original_logprob_env(monkeypatch):
    for name in ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB"):
        monkeypatch.delenv(name, raising=False)
    assert original_logprob_env() is None
    monkeypatch.setenv("RETURN_ORIGINAL_LOGPROB", "0")
    assert original_logprob_env() is None
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "True")
    assert original_logprob_env() == "SGLANG_RETURN_ORIGINAL_LOGPROB"


def test_without_sglang_construction_names_the_gpu_requirements(monkeypatch):
    monkeypatch.setattr(se, "sgl", None)
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        SGLangEngine("some/model")


def test_protocol():
    assert isinstance(SGLangEngine.__new__(SGLangEngine), InferenceEngine)


# ----------------------------------------------------------------- against a strict fake sglang
# The fake enforces what sglang 0.5.23 enforces (tests/contract/ checks the same calls
# against the real wheel):
# - weight updates from tensors only inside a begin_weight_update/end_weight_update
#   session (managers/scheduler_components/weight_updater.py), nested begins refused;
# - the scheduler flushes its cache only when fully idle (Scheduler.is_fully_idle): a
#   request aborted by us keeps it busy for one more iteration after its output came
#   back (a refused flush stands for that iteration). An update with flush_cache=True
#   then fails ("Weights were updated, but the cache was not flushed"), and
#   release_memory_occupation asserts, which kills the scheduler;
# - TokenizerManager.abort_request(rid) sends an abort once per request and drops one
#   for a request it has not registered; the scheduler aborts only the requests it has
#   (an abort that overtakes a request is lost); abort_all always goes through;
# - no generation and no weight load while the GPU memory is released;
# - payloads go through torch's ForkingPickler, as sglang's MultiprocessingSerializer
#   does: a view of a file mapping raises OSError(9) there, for real;
# - LoRA (tokenizer_control_mixin.py): an adapter is loaded under a name that is not
#   loaded already (else success=False), a request's `lora_path` must name a loaded one
#   (TokenizerManager refuses an unknown one), an unload of an unknown name fails, and
#   an unload waits until no request uses the adapter (LoRARegistry.wait_for_unload).
from dataclasses import dataclass  # noqa: E402
from multiprocessing.reduction import ForkingPickler  # noqa: E402


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(kw_only=True)
class UpdateWeightFromDiskReqInput:
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass(kw_only=True)
class LoadLoRAAdapterReqInput:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


@dataclass(kw_only=True)
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: str | None = None


@dataclass(kw_only=True)
class LoRAUpdateOutput:
    success: bool
    error_message: str | None = None


@dataclass(kw_only=True)
class ReleaseMemoryOccupationReqInput:
    tags: list | None = None


@dataclass(kw_only=True)
class ResumeMemoryOccupationReqInput:
    tags: list | None = None


IO_STRUCT = SimpleNamespace(**{c.__name__: c for c in (
    UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput, BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput, ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput,
    LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)})
SERIALIZER = SimpleNamespace(serialize=lambda obj: bytes(ForkingPickler.dumps(obj)),
                             deserialize=lambda data: ForkingPickler.loads(data))
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are "
               "still running or queued.")


class FakeTokenizerManager:
    VOCAB = 1000

    def __init__(self, engine):
        self.engine = engine
        # what sglang's TokenizerManager reads from the model and its server args
        self.model_config = SimpleNamespace(vocab_size=self.VOCAB)
        self.context_len = engine.kwargs.get("context_length", 1 << 20)
        self.num_reserved_tokens = engine.kwargs.get("reserved", 0)
        self.rid_to_state: dict[str, dict] = {}
        self.at_scheduler: set[str] = set()
        self.aborted: set[str] = set()
        self.session = False
        self.busy = 0  # scheduler iterations an aborted request still occupies
        self.released = False
        self.updates, self.aborts_sent, self.fail_loads, self.fail_ends = [], 0, 0, 0
        self.calls: list[str] = []  # control calls, in order
        self.begin_reply = None  # an asyncio.Event the begin's answer waits for, if set
        self.loras: dict[str, str] = {}  # loaded adapter name -> its directory
        self.lora_users: dict[str, int] = {}  # name -> requests running under it

    def _idle(self) -> bool:
        """Scheduler.is_fully_idle; asking is an iteration of the scheduler's loop."""
        if self.engine.inside or self.busy:
            self.busy = max(0, self.busy - 1)
            return False
        return True

    def _check_memory(self, what):
        if self.released:
            raise RuntimeError(f"{what} on released GPU memory (the scheduler would crash)")

    def abort_request(self, rid="", abort_all=False):
        if not abort_all and not rid:
            return
        if not abort_all:
            state = self.rid_to_state.get(rid)
            if state is None or state["abort_sent"]:
                return
            state["abort_sent"] = True
        self.aborts_sent += 1
        self.aborted.update(r for r in self.at_scheduler if abort_all or r.startswith(rid))

    async def flush_cache(self, timeout_s=None):
        self.calls.append("flush")
        if not self._idle():
            return FlushCacheReqOutput(success=False, message="Cache not flushed: pending requests")
        return FlushCacheReqOutput(success=True)

    async def begin_weight_update(self, obj, request):
        assert isinstance(obj, BeginWeightUpdateReqInput)
        self.calls.append("begin")
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        if self.begin_reply is not None:
            await self.begin_reply.wait()
        return True, "Success"

    async def end_weight_update(self, obj, request):
        assert isinstance(obj, EndWeightUpdateReqInput)
        self.calls.append("end")
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        if self.fail_ends:
            self.fail_ends -= 1
            return False, "post_load_weights failed"
        self.session = False
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request):
        assert isinstance(obj, UpdateWeightsFromTensorReqInput)
        self.calls.append("tensor")
        self._check_memory("update_weights_from_tensor")
        if not self.session:
            return False, ("update_weights_from_tensor must run between begin_weight_update() "
                           "and end_weight_update()")
        if self.fail_loads:
            self.fail_loads -= 1
            return False, "Failed to update weights: shape mismatch"
        tensors = [dict(SERIALIZER.deserialize(p)) for p in obj.serialized_named_tensors]
        self.updates.append(("tensor", obj, self.engine.inside, tensors))
        if obj.flush_cache and not self._idle():
            return False, NOT_FLUSHED
        return True, "Success"

    async def load_lora_adapter(self, obj, _):
        assert isinstance(obj, LoadLoRAAdapterReqInput)
        self.calls.append(f"load_lora {obj.lora_name}")
        if obj.lora_name in self.loras:
            return LoRAUpdateOutput(success=False,
                                    error_message=f"LoRA adapter {obj.lora_name} is already loaded")
        self.loras[obj.lora_name] = obj.lora_path
        return LoRAUpdateOutput(success=True)

    async def unload_lora_adapter(self, obj, _):
        assert isinstance(obj, UnloadLoRAAdapterReqInput)
        self.calls.append(f"unload_lora {obj.lora_name}")
        if obj.lora_name not in self.loras:
            return LoRAUpdateOutput(success=False,
                                    error_message=f"LoRA adapter {obj.lora_name} is not loaded")
        while self.lora_users.get(obj.lora_name):  # LoRARegistry.wait_for_unload
            await asyncio.sleep(0.001)
        del self.loras[obj.lora_name]
        return LoRAUpdateOutput(success=True)

    async def update_weights_from_disk(self, obj, request):
        assert isinstance(obj, UpdateWeightFromDiskReqInput)
        self.calls.append("disk")
        self._check_memory("update_weights_from_disk")
        self.updates.append(("disk", obj, self.engine.inside, None))
        if obj.model_path.startswith("/missing"):
            return False, "no such checkpoint", 0
        if obj.flush_cache and not self._idle():
            return False, NOT_FLUSHED, 0
        return True, "Success", 0

    async def release_memory_occupation(self, obj, request):
        assert isinstance(obj, ReleaseMemoryOccupationReqInput)
        self.calls.append("release")
        assert self._idle(), "release_memory_occupation should be called only when server is idle."
        self.released = True

    async def resume_memory_occupation(self, obj, request):
        assert isinstance(obj, ResumeMemoryOccupationReqInput)
        self.calls.append("resume")
        self.released = False


class FakeEngine:
    """Generates one token per 2 ms until the budget is used or the scheduler aborts it;
    a request reaches the scheduler 3 ms after the call (an abort can overtake it)."""

    def __init__(self, **kwargs):
        self.kwargs, self.inside, self.calls = kwargs, 0, 0
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.server_args = SimpleNamespace(
            tp_size=kwargs.get("tp_size", 1),
            enable_memory_saver=kwargs.get("enable_memory_saver", False),
            enable_weights_cpu_backup=kwargs.get("enable_weights_cpu_backup", False),
            enable_lora=kwargs.get("enable_lora", False))
        self.lora_paths: list = []  # each request's lora_path
        # what sglang's spawned scheduler inherits (and its loader reads at exec)
        self.library_path = os.environ.get("LD_LIBRARY_PATH")

    async def async_generate(self, input_ids, sampling_params, return_logprob, logprob_start_len,
                             rid, lora_path=None):
        # -1: the output's logprobs only (generate); 0: the prompt's too (the load probe)
        assert return_logprob and logprob_start_len in (-1, 0)
        tm = self.tokenizer_manager
        tm._check_memory("generate")
        if lora_path is not None and lora_path not in tm.loras:
            raise ValueError(f"LoRA adapter {lora_path} is not loaded")
        self.calls += 1
        self.inside += 1
        self.lora_paths.append(lora_path)
        tm.lora_users[lora_path] = tm.lora_users.get(lora_path, 0) + 1
        tm.rid_to_state[rid] = {"abort_sent": False}
        ids, finish = [], {"type": "length", "length": sampling_params["max_new_tokens"]}
        try:
            await asyncio.sleep(0.003)
            tm.at_scheduler.add(rid)
            while len(ids) < sampling_params["max_new_tokens"]:
                if rid in tm.aborted:
                    finish = ABORT
                    tm.busy = 1  # still in the scheduler's last batch for one iteration
                    break
                await asyncio.sleep(0.002)
                ids.append(100 + len(ids))
        finally:
            self.inside -= 1
            tm.lora_users[lora_path] -= 1
            tm.at_scheduler.discard(rid)
            del tm.rid_to_state[rid]
        out = sglang_out(ids, finish, [-1.0] * len(ids), rid)
        if logprob_start_len == 0:  # sglang's shape: None for the first prompt token
            out["meta_info"]["input_token_logprobs"] = [
                (None if i == 0 else prompt_logprob(t, lora_path), t, None)
                for i, t in enumerate(input_ids)]
        return out


def prompt_logprob(token: int, lora_path) -> float:
    """The fake model's log p of a prompt token: another value under an adapter."""
    return -(token % 97) / 10 - (0.5 if lora_path else 0.0)


@pytest.fixture()
def engine(monkeypatch):
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    monkeypatch.delenv("RETURN_ORIGINAL_LOGPROB", raising=False)
    monkeypatch.setattr(se, "sgl", SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(se, "io_struct", IO_STRUCT)
    monkeypatch.setattr(se, "MultiprocessingSerializer", SERIALIZER)
    monkeypatch.setattr(se, "ABORT_RETRY_S", 0.01)
    return SGLangEngine("some/model", version=3, mem_fraction_static=0.7, tp_size=2)


def test_constructor_sends_token_ids_and_refuses_original_logprobs(engine, monkeypatch):
    assert engine.engine.kwargs == {"model_path": "some/model", "dtype": "bfloat16",
                                    "mem_fraction_static": 0.7, "skip_tokenizer_init": True,
                                    "tp_size": 2}
    assert SGLangEngine("some/model").engine.kwargs["mem_fraction_static"] == se.MEM_FRACTION_STATIC
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangEngine("some/model")


def test_a_seed_without_deterministic_inference_warns_once(engine, caplog):
    with caplog.at_level("WARNING", logger=se.__name__):
        for _ in range(2):
            asyncio.run(engine.generate(GenerationRequest([1], 2, seed=5)))
    assert [r.getMessage() for r in caplog.records if "enable_deterministic_inference" in r.getMessage()] \
        and len(caplog.records) == 1
    det = SGLangEngine("some/model", enable_deterministic_inference=True)
    assert det.deterministic and det.engine.kwargs["enable_deterministic_inference"] is True


def test_zero_budget_does_not_call_the_engine(engine):
    res = asyncio.run(engine.generate(GenerationRequest([1, 2], 0, rid="z")))
    assert (res.output_ids, res.stop_reason, res.rid, engine.engine.calls) == ([], "length", "z", 0)


@pytest.mark.parametrize("req,needle", [
    (GenerationRequest([1, 1000], 4), "prompt token 1 is id 1000, outside the model's vocabulary [0, 1000)"),
    (GenerationRequest([-5], 4), "prompt token 0 is id -5"),
    (GenerationRequest([1] * 60, 4), "the prompt is 60 tokens and the model's context is 60"),
    (GenerationRequest([], 4), "at least one prompt token"),
])
def test_a_request_sglang_cannot_run_is_refused_before_it_reaches_sglang(monkeypatch, req, needle):
    """sglang does not check ids against the vocabulary (an id past the embedding table
    fails on the GPU, for the whole batch); its context counts the reserved tokens."""
    monkeypatch.setattr(se, "sgl", SimpleNamespace(Engine=FakeEngine))
    eng = SGLangEngine("some/model", context_length=64, reserved=4)
    with pytest.raises(ValueError) as e:
        asyncio.run(eng.generate(req))
    assert needle in str(e.value)
    assert eng.engine.calls == 0
    res = asyncio.run(eng.generate(GenerationRequest([1, 2], 1000)))  # cut to the context
    assert len(res.output_ids) == 64 - 4 - 2 and res.stop_reason == "length"


async def _until_running(engine, n=1):
    while engine.load()["running"] < n:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)


def test_abort_update_ends_running_requests_before_the_new_weights(engine):
    state = {"w": torch.arange(4, dtype=torch.float32)}

    async def scenario():
        old = asyncio.ensure_future(engine.generate(GenerationRequest([1], 10_000, rid="old")))
        await _until_running(engine)
        assert engine.load()["outstanding_tokens"] == 10_000
        info = await engine.update_weights(state, version=4)
        new = await engine.generate(GenerationRequest([1], 3, rid="new"))
        return await old, new, info

    old, new, info = asyncio.run(scenario())
    assert old.stop_reason == "abort" and 0 < len(old.output_ids) < 10_000
    assert set(old.versions) == {3}
    assert (new.versions, new.stop_reason) == ([4, 4, 4], "length")
    tm = engine.engine.tokenizer_manager
    kind, obj, inside, tensors = tm.updates[0]
    assert (kind, inside, tm.session) == ("tensor", 0, False)  # nothing ran; session closed
    assert len(tensors) == 2  # one payload per TP rank, each deserialized on its own
    assert all(torch.equal(t["w"], state["w"].to(torch.bfloat16)) for t in tensors)
    # the update leaves the flush to the engine, which asks until the scheduler is idle
    # (the aborted request kept it busy for one iteration) and only then ends the session
    assert obj.weight_version == "4" and not obj.flush_cache
    assert tm.calls == ["begin", "tensor", "flush", "flush", "end"]
    assert info["version"] == 4 == engine.get_version() and info["pause_s"] >= 0
    load = engine.load()
    assert load.pop("busy_s") > 0
    assert load == {"queued": 0, "running": 0, "outstanding_tokens": 0,
                    "tokens": len(old.output_ids) + 3, "aborted_requests": 1}


def test_an_abort_that_overtakes_the_request_is_sent_again(engine):
    # Pause while the request is still on its way to the scheduler: the first abort is
    # lost there, and a per-rid abort would never be sent again (abort_sent).
    async def scenario():
        req = asyncio.ensure_future(engine.generate(GenerationRequest([1], 100_000, rid="r")))
        while engine.load()["running"] < 1:
            await asyncio.sleep(0)
        await asyncio.wait_for(engine.pause("abort"), 5.0)
        await engine.resume()
        return await req

    res = asyncio.run(scenario())
    assert res.stop_reason == "abort" and len(res.output_ids) < 100_000
    assert engine.engine.tokenizer_manager.aborts_sent >= 2


def test_wait_update_lets_running_requests_finish_and_holds_new_ones(engine):
    async def scenario():
        running = asyncio.ensure_future(engine.generate(GenerationRequest([1], 100)))
        await _until_running(engine)
        update = asyncio.ensure_future(engine.update_weights({"w": torch.ones(1)}, 8, mode="wait"))
        while engine.gate.is_open:  # the payload is serialized in a thread first
            await asyncio.sleep(0.001)
        held = asyncio.ensure_future(engine.generate(GenerationRequest([1], 2)))
        await asyncio.sleep(0.005)
        assert engine.load()["queued"] == 1
        return await running, await held, await update

    running, held, _ = asyncio.run(scenario())
    assert (running.stop_reason, len(running.output_ids), set(running.versions)) == ("length", 100, {3})
    assert held.versions == [8, 8]
    assert engine.engine.tokenizer_manager.aborts_sent == 0


def test_shm_views_are_copied_before_the_serializer_sees_them(engine):
    from areal_ray.weights.encoding import SharedMemoryWeights, manifest_of, read_shared
    engine.torch_dtype = torch.float32  # serving in the trainer's dtype: no cast to copy them
    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    shm = SharedMemoryWeights("sglang-test")
    try:
        views = read_shared(shm.write(sd.values(), manifest_of(sd.items())))
        with pytest.raises(OSError):  # what sglang's serializer does with the views as they are
            SERIALIZER.serialize([("w", views["w"])])
        asyncio.run(engine.update_weights(views, version=4))
    finally:
        shm.unlink()
    tensors = engine.engine.tokenizer_manager.updates[0][3]
    assert torch.equal(tensors[0]["w"], sd["w"])


def test_a_failed_load_closes_the_session_keeps_the_gate_closed_and_the_next_push_reopens(engine):
    tm = engine.engine.tokenizer_manager
    tm.fail_loads = 1

    async def scenario():
        with pytest.raises(RuntimeError, match="shape mismatch"):
            await engine.update_weights({"w": torch.ones(1)}, 4)
        assert not tm.session  # ended even though the load failed
        assert engine.get_version() == 3 and not engine.gate.is_open
        assert "shape mismatch" in engine.load_failure()
        # the replica's health check fails, so Serve replaces it
        from deployments.rollout import RolloutServer
        replica = SimpleNamespace(_watcher=None, engine=engine)
        with pytest.raises(RuntimeError, match="replica stopped serving.*shape mismatch"):
            await RolloutServer.func_or_class.check_health(replica)
        await engine.update_weights({"w": torch.ones(1)}, 5)  # the next push reopens the gate
        assert engine.gate.is_open and engine.load_failure() is None
        return await engine.generate(GenerationRequest([1], 1))

    assert asyncio.run(scenario()).versions == [5]


def test_disk_update_needs_no_session_and_a_held_gate_survives_updates(engine):
    async def scenario():
        with pytest.raises(RuntimeError, match="no such checkpoint"):
            await engine.update_weights_from_disk("/missing/5", 5)
        assert engine.engine.tokenizer_manager.updates[0][1].model_path == "/missing/5"
        await engine.resume()
        await engine.pause("wait")
        await engine.update_weights({"w": torch.ones(1)}, 6)
        assert not engine.gate.is_open  # the caller paused, the caller resumes
        await engine.resume()
        return await engine.generate(GenerationRequest([1], 1))

    assert asyncio.run(scenario()).versions == [6]


def test_pause_mode_is_validated(engine):
    with pytest.raises(ValueError, match="pause mode"):
        asyncio.run(engine.pause("retract"))


# ----------------------------------------------------------------- cache flush (audit C4)
async def _abort_one_then(engine, update):
    """Start a long request, then run `update()`: its pause aborts the request, which
    leaves sglang's scheduler busy for one more iteration."""
    req = asyncio.ensure_future(engine.generate(GenerationRequest([1], 10_000)))
    await _until_running(engine)
    info = await update()
    return await req, info


def test_a_disk_update_flushes_once_the_scheduler_is_idle(engine):
    tm = engine.engine.tokenizer_manager
    old, info = asyncio.run(_abort_one_then(
        engine, lambda: engine.update_weights_from_disk("/ckpt/5", 5)))
    assert old.stop_reason == "abort" and info["version"] == 5 and engine.gate.is_open
    assert not tm.updates[0][1].flush_cache
    assert tm.calls == ["disk", "flush", "flush"]  # no session for disk loads


def test_the_flush_gives_up_after_its_deadline(engine, monkeypatch):
    tm = engine.engine.tokenizer_manager
    monkeypatch.setattr(se, "FLUSH_TIMEOUT_S", 0.05)
    monkeypatch.setattr(se, "FLUSH_RETRY_S", 0.01)
    tm.busy = 10**9  # a scheduler that never becomes idle

    async def scenario():
        with pytest.raises(TimeoutError, match="FLUSH_TIMEOUT_S=0.05s"):
            await engine.update_weights({"w": torch.ones(1)}, 4)
        assert not tm.session and not engine.gate.is_open  # session ended; the load failed
        assert "TimeoutError" in engine.load_failure()

    asyncio.run(scenario())
    assert tm.aborts_sent >= 2  # each retry re-sends abort_all


# ----------------------------------------------------------------- sessions (audit M4)
def test_a_failing_end_does_not_hide_the_loads_error(engine):
    tm = engine.engine.tokenizer_manager
    tm.fail_loads, tm.fail_ends = 1, 1
    with pytest.raises(RuntimeError, match="shape mismatch") as err:
        asyncio.run(engine.update_weights({"w": torch.ones(1)}, 4))
    assert "end_weight_update failed: post_load_weights failed" in "".join(err.value.__notes__)
    assert "shape mismatch" in engine.load_failure()
    asyncio.run(engine.update_weights({"w": torch.ones(1)}, 5))  # the left-open session is ended first
    assert engine.gate.is_open and engine.get_version() == 5 and not tm.session


def test_a_push_cancelled_inside_begin_does_not_block_the_next_one(engine):
    tm = engine.engine.tokenizer_manager

    async def scenario():
        tm.begin_reply = asyncio.Event()  # the scheduler opened the session; the answer is late
        push = asyncio.ensure_future(engine.update_weights({"w": torch.ones(1)}, 4))
        while "begin" not in tm.calls:
            await asyncio.sleep(0.001)
        push.cancel()
        with pytest.raises(asyncio.CancelledError):
            await push
        assert tm.session  # left open in the scheduler
        tm.begin_reply = None
        return await engine.update_weights({"w": torch.ones(1)}, 5)

    assert asyncio.run(scenario())["version"] == 5
    assert tm.calls == ["begin", "end", "begin", "tensor", "flush", "end"] and not tm.session
    assert engine.gate.is_open and engine.load_failure() is None


# ----------------------------------------------------------------- memory (audit O1, O3)
def test_tp_above_one_sends_cpu_tensors(engine, monkeypatch):
    seen, real = [], se.named_tensors

    def named(tensors, dtype=None, cpu=False):
        seen.append(cpu)
        return real(tensors, dtype, cpu)

    monkeypatch.setattr(se, "named_tensors", named)
    se.tensor_update_request({"w": torch.ones(1)}, 1, tp_size=2)
    se.tensor_update_request({"w": torch.ones(1)}, 1, tp_size=1)
    assert seen == [True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_go_as_cpu_copies_when_asked():
    sd = {"w": torch.ones(2, device="cuda")}
    assert named_tensors(sd)[0][1].is_cuda
    assert named_tensors(sd, torch.bfloat16, cpu=True)[0][1].device.type == "cpu"


def test_the_replicas_cached_cuda_blocks_are_freed_after_each_swap(engine, monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    engine.engine.tokenizer_manager.fail_loads = 1
    with pytest.raises(RuntimeError):
        asyncio.run(engine.update_weights({"w": torch.ones(1)}, 4))
    asyncio.run(engine.update_weights({"w": torch.ones(1)}, 5))
    assert len(emptied) == 2  # after the failed swap too


async def _buckets(state: dict, per_bucket: int, alive: list):
    """An async source of (name, tensor) buckets that counts the buckets still referenced."""
    import weakref
    items = list(state.items())
    for i in range(0, len(items), per_bucket):
        bucket = [(n, t.clone()) for n, t in items[i:i + per_bucket]]
        alive.append(weakref.ref(bucket[0][1]))
        yield bucket
        del bucket


def test_buckets_stream_into_one_session(engine):
    tm = engine.engine.tokenizer_manager
    state = {f"layer{i}.w": torch.full((3,), float(i)) for i in range(5)}
    alive = []
    tensor_calls = []

    async def scenario():
        real = tm.update_weights_from_tensor

        async def update(obj, request):  # how many earlier buckets are still referenced
            import gc
            gc.collect()
            tensor_calls.append(sum(r() is not None for r in alive[:-1]))
            return await real(obj, request)

        tm.update_weights_from_tensor = update
        old, info = await _abort_one_then(engine, lambda: engine.update_weights_from_buckets(
            _buckets(state, 2, alive), 6))
        return info

    assert asyncio.run(scenario())["version"] == 6
    assert tm.calls == ["begin", "tensor", "tensor", "tensor", "flush", "flush", "end"]
    assert tensor_calls == [0, 0, 0]  # a loaded bucket is dropped before the next arrives
    loaded = {}
    for _, obj, inside, tensors in tm.updates:
        assert inside == 0 and obj.weight_version == "6" and not obj.flush_cache
        loaded.update(tensors[0])
    assert set(loaded) == set(state) and all(torch.equal(loaded[k].float(), v) for k, v in state.items())
    assert engine.gate.is_open and engine.get_version() == 6


def test_a_failed_bucket_closes_the_source_and_the_session(engine):
    tm = engine.engine.tokenizer_manager
    tm.fail_loads = 1
    closed = []

    async def source():
        try:
            for i in range(3):
                yield [(f"w{i}", torch.ones(1))]
        finally:
            closed.append(True)

    with pytest.raises(RuntimeError, match="shape mismatch"):
        asyncio.run(engine.update_weights_from_buckets(source(), 4))
    assert closed == [True] and not tm.session and not engine.gate.is_open


@pytest.mark.engine  # a gloo WeightGroup between processes or threads
def test_a_broadcast_streams_bucket_by_bucket_into_sglang(engine):
    """The collective receiver's stream, fed by a real WeightGroup send over gloo."""
    import threading

    from areal_ray.weights.encoding import manifest_of
    from areal_ray.weights.group import WeightGroup, free_port
    from areal_ray.weights.payloads import CollectivePayload
    from areal_ray.weights.receivers import WeightReceiver
    from areal_ray.weights.tensor_spec import plan_buckets

    engine.torch_dtype = torch.float32
    g = torch.Generator().manual_seed(0)
    sd = {f"l{i}.w": torch.randn(16, 16, generator=g) for i in range(4)}
    sd["norm"] = torch.randn(16, generator=g)
    specs = tuple(manifest_of(sd.items()))
    port = free_port()
    store = WeightGroup.connect("127.0.0.1", port, 10, is_master=True)
    payload = CollectivePayload(1, ("127.0.0.1", port), {"a": 1}, 2, specs, 2048)
    receiver = WeightReceiver("a", timeout_s=10)
    assert receiver.streams(payload)
    errors = []

    def send():
        try:
            WeightGroup(store, 1, 0, 2, timeout_s=10).send(iter(sd.values()), list(specs), 2048)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    info = asyncio.run(engine.update_weights_from_buckets(receiver.stream(payload), 7))
    sender.join(30)
    assert not errors and info["version"] == 7
    tm = engine.engine.tokenizer_manager
    n_buckets = len(plan_buckets(list(specs), 2048))
    assert n_buckets > 1 and tm.calls.count("tensor") == n_buckets and tm.calls.count("begin") == 1
    loaded = {k: v for _, _, _, tensors in tm.updates for k, v in tensors[0].items()}
    assert set(loaded) == set(sd) and all(torch.equal(loaded[k], v) for k, v in sd.items())
    assert receiver.receiver_for(payload)._group.transfers == 1  # the group stays for the next push


# ----------------------------------------------------------------- memory release
@pytest.fixture()
def saver(engine):
    """An engine built with sglang's memory saver (and no CPU backup of the weights)."""
    return SGLangEngine("some/model", version=3, enable_memory_saver=True)


def test_release_needs_the_memory_saver(engine):
    assert "enable_memory_saver" not in engine.engine.kwargs
    with pytest.raises(RuntimeError, match="enable_memory_saver=True"):
        asyncio.run(engine.release_memory())
    assert engine.engine.tokenizer_manager.calls == [] and engine.gate.is_open


def test_release_aborts_waits_for_idle_and_holds_requests_until_resumed(saver):
    tm = saver.engine.tokenizer_manager
    assert saver.engine.kwargs["enable_memory_saver"] is True
    saver.engine.server_args.enable_weights_cpu_backup = True

    async def scenario():
        old, _ = await _abort_one_then(saver, saver.release_memory)
        assert tm.released and not saver.gate.is_open
        # the release came once the scheduler was idle (it asserts that)
        assert tm.calls == ["flush", "flush", "release"]
        held = asyncio.ensure_future(saver.generate(GenerationRequest([1], 2)))
        await asyncio.sleep(0.01)
        assert saver.load()["queued"] == 1 and saver.engine.calls == 1  # waits at our gate
        with pytest.raises(RuntimeError, match="resume_memory"):
            await saver.update_weights({"w": torch.ones(1)}, 4)
        await saver.resume_memory()
        return old, await held

    old, held = asyncio.run(scenario())
    assert old.stop_reason == "abort" and held.versions == [3, 3] and saver.gate.is_open
    assert tm.calls[-1] == "resume" and not tm.released and saver.load_failure() is None


def test_without_a_weight_backup_the_gate_reopens_after_the_next_load(saver):
    async def scenario():
        await saver.release_memory()
        await saver.resume_memory()
        assert not saver.gate.is_open  # the weights' memory came back undefined
        await saver.resume_memory()
        assert not saver.gate.is_open
        held = asyncio.ensure_future(saver.generate(GenerationRequest([1], 2)))
        await asyncio.sleep(0.01)
        await saver.update_weights({"w": torch.ones(1)}, 4)
        return await held

    assert asyncio.run(scenario()).versions == [4, 4] and saver.gate.is_open


def test_the_strict_fake_refuses_what_sglang_refuses(saver):
    tm = saver.engine.tokenizer_manager

    async def scenario():
        req = asyncio.ensure_future(saver.generate(GenerationRequest([1], 10_000)))
        await _until_running(saver)
        with pytest.raises(AssertionError, match="only when server is idle"):
            await tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
        tm.abort_request(abort_all=True)
        await req
        assert not (await tm.flush_cache()).success  # busy one more iteration
        await tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
        with pytest.raises(RuntimeError, match="released GPU memory"):
            await saver.engine.async_generate([1], {"max_new_tokens": 1}, True, -1, "x")

    asyncio.run(scenario())


# ----------------------------------------------------------------- LoRA (model.lora)
def lora_adapter(seed: int):
    from areal_ray.weights.adapter import Adapter
    from areal_ray.weights.payloads import AdapterMeta
    g = torch.Generator().manual_seed(seed)
    meta = AdapterMeta("some/model", "", rank=2, alpha=4.0, scaling=2.0, targets=("q_proj",))
    return Adapter(meta, {"model.layers.0.self_attn.q_proj.lora_A": torch.randn(2, 8, generator=g),
                          "model.layers.0.self_attn.q_proj.lora_B": torch.randn(8, 2, generator=g)})


@pytest.fixture()
def lora_engine(engine, monkeypatch, tmp_path):
    monkeypatch.setattr("areal_ray.rollout.engines.adapters.staging_dir", lambda nbytes: tmp_path)
    return SGLangEngine("some/model", version=0, lora_rank=2, lora_targets=("v_proj", "q_proj"),
                        lora_slots=4)


def test_lora_server_args_and_the_adapter_each_request_names(lora_engine, tmp_path):
    kw = lora_engine.engine.kwargs
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["lora_target_modules"],
            kw["max_loras_per_batch"]) == (True, 2, ["q_proj", "v_proj"], 5)
    assert se.lora_server_args(0, ["q_proj"]) == {}
    tm = lora_engine.engine.tokenizer_manager

    async def scenario():
        first = await lora_engine.generate(GenerationRequest([1], 2))  # the base: no adapter
        names = []
        for version in (1, 2):
            info = await lora_engine.update_adapter(lora_adapter(version), version)
            assert info["adapter_modules"] == 1
            res = await lora_engine.generate(GenerationRequest([1], 2))
            assert res.versions == [version] * 2
            names.append(lora_engine.engine.lora_paths[-1])
        return first, names

    first, names = asyncio.run(scenario())
    assert first.versions == [0, 0] and lora_engine.engine.lora_paths[0] is None
    assert names[0] != names[1] and names[1].startswith("areal-v2-")  # a new name per version
    assert list(tm.loras) == [names[1]]  # the first was unloaded: no request used it
    [served] = [p for p in tmp_path.iterdir()]  # only the served adapter's directory is left
    assert sorted(f.name for f in served.iterdir()) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
    assert tm.calls.count("begin") == 0  # an adapter needs no weight-update session


@pytest.mark.parametrize("mode", ["abort", "finish"])
def test_a_request_in_flight_across_an_adapter_push_keeps_its_version(lora_engine, mode):
    """abort (rollout.lora_push=pause): ended and resubmitted by its client, the rest
    under the new adapter; finish: it runs to its end under the adapter it started with,
    beside new requests under the new one, and its adapter is unloaded after it."""
    tm = lora_engine.engine.tokenizer_manager

    async def scenario():
        await lora_engine.update_adapter(lora_adapter(1), 1)
        old = list(tm.loras)[0]
        running = asyncio.ensure_future(lora_engine.generate(GenerationRequest([1], 100)))
        await _until_running(lora_engine)
        await lora_engine.update_adapter(lora_adapter(2), 2, mode)
        loaded_after_push = sorted(tm.loras)
        fresh = await lora_engine.generate(GenerationRequest([1], 2))
        return old, await running, loaded_after_push, fresh

    old, res, loaded, fresh = asyncio.run(scenario())
    new = lora_engine.engine.lora_paths[-1]
    assert fresh.versions == [2, 2] and new != old
    assert res.versions == [1] * len(res.output_ids)
    if mode == "abort":
        assert res.stop_reason == "abort" and len(res.output_ids) < 100 and loaded == [new]
    else:
        assert res.stop_reason == "length" and len(res.output_ids) == 100
        assert loaded == sorted([old, new])  # the old one stayed while its request ran
    assert list(tm.loras) == [new] and lora_engine.adapters()["loaded"] == [2]


def test_a_full_push_serves_plain_weights_and_unloads_the_adapter(lora_engine):
    tm = lora_engine.engine.tokenizer_manager

    async def scenario():
        await lora_engine.update_adapter(lora_adapter(1), 1)
        await lora_engine.update_weights({"w": torch.ones(2)}, 2)
        return await lora_engine.generate(GenerationRequest([1], 2))

    res = asyncio.run(scenario())
    assert res.versions == [2, 2] and lora_engine.engine.lora_paths[-1] is None and tm.loras == {}


def test_an_adapter_needs_an_engine_built_with_lora(engine):
    with pytest.raises(RuntimeError, match="built without LoRA"):
        asyncio.run(engine.update_adapter(lora_adapter(1), 1))


# ----------------------------------------------------------------- the memory saver's library path
def fake_site(root, version="13.0.96", lib="libcudart.so.13"):
    """A site-packages dir as pip leaves it after installing nvidia-cuda-runtime: the
    library under nvidia/, and the distribution's RECORD listing it."""
    (root / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (root / "nvidia" / "cu13" / "lib" / lib).write_bytes(b"")
    info = root / f"nvidia_cuda_runtime-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-cuda-runtime\nVersion: {version}\n")
    (info / "RECORD").write_text(f"nvidia/cu13/lib/{lib},,\n{info.name}/METADATA,,\n")
    return root / "nvidia" / "cu13" / "lib"


def test_cudart_dir_finds_the_runtime_torch_loads(tmp_path):
    lib_dir = fake_site(tmp_path)
    assert se.cudart_dir("13.0", [], [str(tmp_path)]) == str(lib_dir)
    assert se.cudart_dir("12.8", [], [str(tmp_path)]) is None  # another major's runtime
    assert se.cudart_dir(None, [], [str(tmp_path)]) is None  # a CPU build of torch
    assert se.cudart_dir("13.0", [], [str(tmp_path / "empty")]) is None
    # the one this process mapped wins (a symlinked system install maps its full version)
    maps = ["7f00-7f01 r-xp 00000000 08:01 42 /usr/local/cuda/lib64/libcudart.so.13.0.96\n"]
    assert se.cudart_dir("13.0", maps, [str(tmp_path)]) == "/usr/local/cuda/lib64"


def test_the_memory_saver_puts_torchs_cuda_runtime_on_the_schedulers_library_path(
        engine, monkeypatch, tmp_path):
    """sglang spawns its scheduler with torch_memory_saver's hook in LD_PRELOAD; the hook
    needs libcudart.so.13, which a pip environment keeps in site-packages (R3-C2)."""
    lib_dir = fake_site(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    saver = SGLangEngine("some/model", enable_memory_saver=True)
    assert saver.engine.library_path == f"{lib_dir}{os.pathsep}/opt/other"
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    plain = SGLangEngine("some/model")  # no memory saver: no hook, nothing to add
    assert plain.engine.library_path == "/opt/other"


# ----------------------------------------------------------------- /dev/shm room (R3-C5)
@pytest.fixture()
def shm_free(monkeypatch):
    """The free-space probe of /dev/shm answers `free[0]` (a real small tmpfs needs root)."""
    from areal_ray.weights import staging
    free = [1 << 40]
    monkeypatch.setattr(staging, "free_bytes", lambda p: free[0])
    return free


def test_shm_buckets_are_bounded_and_keep_order():
    sd = {f"w{i}": torch.ones(n) for i, n in enumerate([4, 4, 10, 1, 1])}
    buckets = se.shm_buckets(sd, 32)  # float32: 16, 16, 40, 4, 4 bytes
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    assert se.shared_bytes(sd) == 80 and se.shared_bytes(sd, torch.bfloat16) == 40


def test_a_push_that_does_not_fit_in_shm_goes_in_bounded_buckets_in_one_session(
        engine, shm_free, monkeypatch):
    from areal_ray.weights.staging import SHM_MARGIN
    engine.torch_dtype = torch.float32
    sd = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}  # 1 KiB each
    monkeypatch.setattr(se, "SHM_BUCKET_BYTES", 2048)
    shm_free[0] = SHM_MARGIN + 3000  # the bucket fits, the whole push does not
    tm = engine.engine.tokenizer_manager
    info = asyncio.run(engine.update_weights(sd, 4))
    assert info["version"] == 4 and engine.gate.is_open
    assert tm.calls.count("begin") == 1 and tm.calls.count("tensor") == 2
    loaded = [u[3][0] for u in tm.updates]  # rank 0's tensors of each update
    assert [sorted(t) for t in loaded] == [["w0", "w1"], ["w2", "w3"]]
    assert all(torch.equal(t[n], sd[n]) for t in loaded for n in t)


def test_a_push_with_no_room_in_shm_fails_before_the_pause_naming_the_fix(engine, shm_free):
    shm_free[0] = 64 << 20  # Docker's default /dev/shm
    sd = {"w": torch.ones(32 << 20, dtype=torch.bfloat16)}  # 64 MiB plus the margin: no room
    with pytest.raises(OSError, match=r"needs 0.06 GiB of shared memory in /dev/shm.*--shm-size"):
        asyncio.run(engine.update_weights(sd, 4))
    tm = engine.engine.tokenizer_manager
    assert tm.calls == [] and engine.gate.is_open and engine.load_failure() is None


def test_a_push_that_fails_before_the_swap_after_a_blind_resume_fails_the_health_check(
        saver, shm_free):
    """R3-H1: resumed without its weights, the gate waits for a load; a push that fails
    before its swap (here /dev/shm) must not leave the replica closed but healthy."""
    from deployments.rollout import RolloutServer

    async def scenario():
        await saver.release_memory()
        await saver.resume_memory()
        assert not saver.gate.is_open
        shm_free[0] = 0
        with pytest.raises(OSError, match="shared memory"):
            await saver.update_weights({"w": torch.ones(4)}, 4)
        replica = SimpleNamespace(_watcher=None, engine=saver)
        with pytest.raises(RuntimeError, match="replica stopped serving: loading v4 failed: "
                                               "OSError.*shared memory"):
            await RolloutServer.func_or_class.check_health(replica)
        shm_free[0] = 1 << 40
        await saver.update_weights({"w": torch.ones(4)}, 5)  # a good load reopens
        return await saver.generate(GenerationRequest([1], 1))

    assert asyncio.run(scenario()).versions == [5] and saver.load_failure() is None


def test_a_push_that_fails_with_the_gate_open_is_no_replica_failure(engine):
    """An error before the swap of a serving engine leaves it serving the old weights."""
    with pytest.raises(AttributeError):
        asyncio.run(engine.update_weights({"w": "not a tensor"}, 4))
    assert engine.gate.is_open and engine.load_failure() is None


# ----------------------------------------------------------------- release + LoRA (R3-W1)
def test_release_with_lora_keeps_a_cpu_copy_of_the_base_weights(engine):
    from areal_ray.rollout.engines.base import EngineOptions
    opts = EngineOptions(release_memory=True, lora_rank=2, lora_targets=("q_proj",))
    built = SGLangEngine.from_options("some/model", opts)
    assert built.engine.kwargs["enable_weights_cpu_backup"] is True
    assert built.engine.kwargs["enable_memory_saver"] is True
    plain = SGLangEngine.from_options("some/model", EngineOptions(release_memory=True))
    assert "enable_weights_cpu_backup" not in plain.engine.kwargs  # full pushes reload them
    no_backup = EngineOptions(release_memory=True, lora_rank=2, lora_targets=("q_proj",),
                              engine_kwargs={"enable_weights_cpu_backup": False})
    with pytest.raises(ValueError, match="enable_weights_cpu_backup"):
        SGLangEngine.from_options("some/model", no_backup)


def test_an_adapter_is_never_served_on_undefined_base_weights(engine, monkeypatch, tmp_path):
    """Without the CPU copy the base weights come back from a release undefined: an
    adapter push must fail the replica, not reopen the gate over them."""
    monkeypatch.setattr("areal_ray.rollout.engines.adapters.staging_dir", lambda nbytes: tmp_path)
    eng = SGLangEngine("some/model", version=0, lora_rank=2, lora_targets=("q_proj",),
                       enable_memory_saver=True)

    async def scenario():
        await eng.release_memory()
        await eng.resume_memory()
        with pytest.raises(RuntimeError, match="undefined"):
            await eng.update_adapter(lora_adapter(1), 1)
        return eng.gate.is_open, eng.load_failure()

    is_open, failure = asyncio.run(scenario())
    assert not is_open and "loading v1 failed" in failure and eng.engine.calls == 0


def test_the_load_probe_is_scored_from_sglangs_prompt_logprobs(engine):
    """weights/probe.py on sglang: `score` asks for the prompt's logprobs from position 0
    at temperature 1 through the gate, and returns those of ids[1:]."""
    ids = [3, 7922, 15841, 200]
    assert asyncio.run(engine.score(ids)) == [prompt_logprob(t, None) for t in ids[1:]]
    assert engine.engine.calls == 1 and engine.engine.inside == 0
