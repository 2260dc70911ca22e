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
from types import SimpleNamespace

import pytest
import torch

from areal_ray.rollout import sglang_engine as se
from areal_ray.rollout.engine import GenerationRequest, InferenceEngine
from areal_ray.rollout.sglang_engine import (
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
# - TokenizerManager.abort_request(rid) sends an abort once per request and drops one
#   for a request it has not registered; the scheduler aborts only the requests it has
#   (an abort that overtakes a request is lost); abort_all always goes through;
# - payloads go through torch's ForkingPickler, as sglang's MultiprocessingSerializer
#   does: a view of a file mapping raises OSError(9) there, for real.
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


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


IO_STRUCT = SimpleNamespace(**{c.__name__: c for c in (
    UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput, BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput)})
SERIALIZER = SimpleNamespace(serialize=lambda obj: bytes(ForkingPickler.dumps(obj)),
                             deserialize=lambda data: ForkingPickler.loads(data))


class FakeTokenizerManager:
    def __init__(self, engine):
        self.engine = engine
        self.rid_to_state: dict[str, dict] = {}
        self.at_scheduler: set[str] = set()
        self.aborted: set[str] = set()
        self.session = False
        self.updates, self.aborts_sent, self.fail_loads = [], 0, 0

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

    async def begin_weight_update(self, obj, request):
        assert isinstance(obj, BeginWeightUpdateReqInput)
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    async def end_weight_update(self, obj, request):
        assert isinstance(obj, EndWeightUpdateReqInput)
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request):
        assert isinstance(obj, UpdateWeightsFromTensorReqInput)
        if not self.session:
            return False, ("update_weights_from_tensor must run between begin_weight_update() "
                           "and end_weight_update()")
        if self.fail_loads:
            self.fail_loads -= 1
            return False, "Failed to update weights: shape mismatch"
        tensors = [dict(SERIALIZER.deserialize(p)) for p in obj.serialized_named_tensors]
        self.updates.append(("tensor", obj, self.engine.inside, tensors))
        return True, "Success"

    async def update_weights_from_disk(self, obj, request):
        assert isinstance(obj, UpdateWeightFromDiskReqInput)
        self.updates.append(("disk", obj, self.engine.inside, None))
        return False, "no such checkpoint", 0


class FakeEngine:
    """Generates one token per 2 ms until the budget is used or the scheduler aborts it;
    a request reaches the scheduler 3 ms after the call (an abort can overtake it)."""

    def __init__(self, **kwargs):
        self.kwargs, self.inside, self.calls = kwargs, 0, 0
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.server_args = SimpleNamespace(tp_size=2)

    async def async_generate(self, input_ids, sampling_params, return_logprob, logprob_start_len,
                             rid):
        assert return_logprob and logprob_start_len == -1
        tm = self.tokenizer_manager
        self.calls += 1
        self.inside += 1
        tm.rid_to_state[rid] = {"abort_sent": False}
        ids, finish = [], {"type": "length", "length": sampling_params["max_new_tokens"]}
        try:
            await asyncio.sleep(0.003)
            tm.at_scheduler.add(rid)
            while len(ids) < sampling_params["max_new_tokens"]:
                if rid in tm.aborted:
                    finish = ABORT
                    break
                await asyncio.sleep(0.002)
                ids.append(100 + len(ids))
        finally:
            self.inside -= 1
            tm.at_scheduler.discard(rid)
            del tm.rid_to_state[rid]
        return sglang_out(ids, finish, [-1.0] * len(ids), rid)


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
    assert obj.weight_version == "4" and obj.flush_cache
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
        running = asyncio.ensure_future(engine.generate(GenerationRequest([1], 20)))
        await _until_running(engine)
        update = asyncio.ensure_future(engine.update_weights({"w": torch.ones(1)}, 8, mode="wait"))
        await asyncio.sleep(0.005)
        held = asyncio.ensure_future(engine.generate(GenerationRequest([1], 2)))
        await asyncio.sleep(0.005)
        assert engine.load()["queued"] == 1
        return await running, await held, await update

    running, held, _ = asyncio.run(scenario())
    assert (running.stop_reason, len(running.output_ids), set(running.versions)) == ("length", 20, {3})
    assert held.versions == [8, 8]
    assert engine.engine.tokenizer_manager.aborts_sent == 0


def test_shm_views_are_copied_before_the_serializer_sees_them(engine):
    from areal_ray.weights import SharedMemoryWeights, manifest_of, read_shared
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
            await engine.update_weights_from_disk("/ckpt/5", 5)
        assert engine.engine.tokenizer_manager.updates[0][1].model_path == "/ckpt/5"
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
