"""Our SGLang calls against the real sglang 0.5.23 wheel (no GPU: its Python layer only).

Run by `make test-contract` (also part of `make test`), which installs the wheel with
--no-deps into .contract/site and puts it and a torchvision stub on PYTHONPATH. What
is checked is what the GPU audit (docs/gpu.md) found wrong or unchecked: the request classes and fields
we build, the signatures we call, the sampling params sglang validates, the finish
reasons we parse, the weight-update session rules (with sglang's own scheduler-side
SchedulerWeightUpdaterManager deciding), the cache flush that waits for an idle
scheduler, the memory release/resume calls, and the serializer with every weight path's
tensors, deserialized in another process as sglang's scheduler does. What cannot run
here: the Engine itself (its scheduler needs CUDA kernels), CUDA IPC, NCCL.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

sglang = pytest.importorskip("sglang", reason="run through `make test-contract`")

from sglang.srt.entrypoints.engine import Engine  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper  # noqa: E402
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, record_fields  # noqa: E402
from sglang.srt.utils import MultiprocessingSerializer  # noqa: E402
from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads  # noqa: E402

from areal_ray.rollout.engines import sglang as se  # noqa: E402
from areal_ray.rollout.engines.base import GenerationRequest  # noqa: E402
from areal_ray.weights.encoding import SharedMemoryWeights, manifest_of, put_state, read_shared, state_from  # noqa: E402


def test_our_module_binds_the_real_package():
    assert se.io_struct is io_struct and se.MultiprocessingSerializer is MultiprocessingSerializer
    assert se.sgl.Engine.async_generate is Engine.async_generate


def test_engine_kwargs_are_server_args_fields():
    fields = {f.name for f in record_fields(ServerArgs)}
    assert {"model_path", "dtype", "mem_fraction_static", "skip_tokenizer_init", "tp_size"} <= fields
    params = inspect.signature(Engine.async_generate).parameters
    assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid"} <= set(params)


@pytest.mark.parametrize("method", ["update_weights_from_tensor", "update_weights_from_disk",
                                    "begin_weight_update", "end_weight_update",
                                    "release_memory_occupation", "resume_memory_occupation"])
def test_control_calls_are_coroutines_taking_obj_and_request(method):
    fn = getattr(TokenizerManager, method)
    assert inspect.iscoroutinefunction(fn)
    assert list(inspect.signature(fn).parameters)[:3] == ["self", "obj", "request"]


def test_flush_cache_is_a_coroutine_answering_success_or_failure():
    fn = TokenizerManager.flush_cache
    assert inspect.iscoroutinefunction(fn)
    params = inspect.signature(fn).parameters
    assert list(params) == ["self", "timeout_s"] and params["timeout_s"].default is None
    assert inspect.signature(fn).return_annotation in ("FlushCacheReqOutput", io_struct.FlushCacheReqOutput)
    fields = {f.name: f for f in record_fields(io_struct.FlushCacheReqOutput)}
    assert set(fields) >= {"success", "message"}


def test_a_flush_while_the_scheduler_is_busy_answers_failure_instead_of_raising():
    """What `_flush_cache` relies on: the scheduler's flush handler, asked without a
    timeout, answers at once with success=False while it is not fully idle."""
    busy = [True]
    flushed = []
    wrapper = SchedulerFlushWrapper(
        flush_cache=lambda: flushed.append(1) or not busy[0],
        is_fully_idle=lambda: not busy[0], send_output=lambda out, req: None)
    out = wrapper.handle(io_struct.FlushCacheReqInput())
    assert isinstance(out, io_struct.FlushCacheReqOutput) and not out.success
    busy[0] = False
    assert wrapper.handle(io_struct.FlushCacheReqInput()).success
    # the scheduler's flush itself decides by is_fully_idle, whose conditions include
    # the last batch and the overlap result queue (an aborted request lingers there)
    src = inspect.getsource(Scheduler.flush_cache)
    assert "self.is_fully_idle(" in src
    idle_src = inspect.getsource(Scheduler.is_fully_idle)
    assert "self.last_batch" in idle_src and "self.result_queue" in idle_src


def test_memory_release_classes_and_server_args():
    for cls in (io_struct.ReleaseMemoryOccupationReqInput, io_struct.ResumeMemoryOccupationReqInput):
        fields = {f.name: f for f in record_fields(cls)}
        assert fields["tags"].default is None  # None: every kind of memory (weights, KV, graphs)
        assert cls(tags=None).tags is None
    args = {f.name: f for f in record_fields(ServerArgs)}
    assert args["enable_memory_saver"].default is False
    assert args["enable_weights_cpu_backup"].default is False


def test_the_limits_we_read_are_what_the_tokenizer_manager_checks_requests_against():
    """engine_limits reads TokenizerManager.model_config.vocab_size, context_len and
    num_reserved_tokens; the manager sets them at start (init_model_config, which needs
    a model)
    and refuses a prompt plus budget past context_len counting the reserved tokens."""
    from sglang.srt.configs.model_config import ModelConfig
    assert "self.init_model_config()" in inspect.getsource(TokenizerManager.__init__)
    init = inspect.getsource(TokenizerManager.init_model_config)
    for attr in ("self.model_config = ", "self.context_len = self.model_config.context_len",
                 "self.num_reserved_tokens = "):
        assert attr in init
    assert "self.vocab_size = " in inspect.getsource(ModelConfig)
    check = inspect.getsource(TokenizerManager._validate_one_request)
    assert "input_token_num += self.num_reserved_tokens" in check
    assert "(max_new_tokens + input_token_num) > _max_req_len" in check
    tm = SimpleNamespace(model_config=SimpleNamespace(vocab_size=151936), context_len=4096,
                         num_reserved_tokens=2)
    assert se.engine_limits(SimpleNamespace(tokenizer_manager=tm)).max_context == 4094


def test_abort_request_signature():
    assert list(inspect.signature(TokenizerManager.abort_request).parameters) == ["self", "rid", "abort_all"]


@pytest.mark.parametrize("req", [GenerationRequest([1], 16, temperature=0.7),
                                 GenerationRequest([1], 4, temperature=0.0, ignore_eos=True)])
def test_sampling_params_are_accepted_by_sglang(req):
    sp = SamplingParams(**se.sampling_params(req))
    sp.verify(vocab_size=1000)
    assert (sp.top_p, sp.min_p) == (1.0, 0.0)


def test_a_request_seed_is_sglangs_sampling_seed_under_deterministic_inference():
    req = GenerationRequest([1], 16, temperature=1.0, seed=2**63 - 1)
    sp = SamplingParams(**se.sampling_params(req))
    sp.verify(vocab_size=1000)  # sglang's range check: [-2**63, 2**63 - 1]
    assert sp.sampling_seed == 2**63 - 1
    assert "sampling_seed" not in se.sampling_params(GenerationRequest([1], 16, temperature=1.0))
    # the server arg that makes sglang use it (per-row seeded sampling, batch-invariant ops)
    assert "enable_deterministic_inference" in {f.name for f in record_fields(ServerArgs)}
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    src = inspect.getsource(SamplingBatchInfo.from_schedule_batch)
    assert "r.sampling_params.sampling_seed" in src and "if enable_deterministic" in src


def _out(ids, finish_json):
    return {"output_ids": ids, "meta_info": {"finish_reason": finish_json,
                                             "output_token_logprobs": [(-0.5, t, None) for t in ids]}}


def test_real_finish_reasons_parse():
    assert se.parse_output(_out([5, 2], FINISH_MATCHED_TOKEN(matched=2).to_json()), 1, 9).stop_reason == "stop"
    assert se.parse_output(_out([5, 6], FINISH_LENGTH(length=2).to_json()), 1, 9).stop_reason == "length"
    assert se.parse_output(_out([5], FINISH_ABORT("Aborted").to_json()), 1, 9).stop_reason == "abort"


def test_request_objects_are_the_real_classes():
    obj = se.tensor_update_request({"w": torch.ones(2)}, 7, tp_size=2, dtype=torch.bfloat16)
    assert isinstance(obj, io_struct.UpdateWeightsFromTensorReqInput)
    assert obj.weight_version == "7" and not obj.flush_cache and len(obj.serialized_named_tensors) == 2
    assert normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors) == obj.serialized_named_tensors
    disk = se.disk_update_request("/ckpt/v7", 7)
    assert isinstance(disk, io_struct.UpdateWeightFromDiskReqInput) and disk.model_path == "/ckpt/v7"
    assert not disk.flush_cache  # the engine flushes once the scheduler is idle


# ----------------------------------------------------------------- weight-update sessions
class Runner:
    """A model runner's weight updater: records what sglang's manager hands it."""

    def __init__(self):
        self.loaded, self.calls = [], []

    def begin_weight_update(self):
        self.calls.append("begin")

    def end_weight_update(self, *, run_post_load):
        self.calls.append(("end", run_post_load))

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        self.loaded.append(dict(named_tensors))
        return True, "Success"


@pytest.fixture
def manager():
    """sglang's own scheduler-side weight updater, with stand-ins for the GPU worker."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    runner = Runner()
    versions = []
    sched = SimpleNamespace(busy=0, _engine_paused=False,
                            record_weight_version_change=lambda new_version: versions.append(new_version))

    def flush_cache(empty_cache=True):  # Scheduler.flush_cache: only when fully idle
        if sched.busy:
            sched.busy -= 1  # one scheduler iteration later the last batch is gone
            return False
        return True

    m = object.__new__(SchedulerWeightUpdaterManager)  # __post_init__ needs sglang's TP state
    tp_worker = SimpleNamespace(
        weight_update_runners=lambda: [("target", SimpleNamespace(weight_updater=runner))],
        # TpModelWorker.deserialize_own_rank, for TP rank 0
        deserialize_own_rank=lambda payloads: MultiprocessingSerializer.deserialize(payloads[0]))
    for k, v in dict(tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None,
                     flush_cache=flush_cache, is_fully_idle=lambda **kw: not sched.busy, scheduler=sched,
                     metrics_collector=None, offload_tags=set(), stashed_model_static_state=None,
                     _session=None, tp_cpu_group=None).items():
        setattr(m, k, v)
    try:
        yield m, runner, versions
    finally:
        dist.destroy_process_group()


class ManagerBackedTokenizerManager:
    """Forwards our control calls to the real manager, as the TokenizerManager's
    communicators do, and answers (success, message) as its merge_results does."""

    model_config = SimpleNamespace(vocab_size=1000)  # what engine_limits reads
    context_len = 1 << 20

    def __init__(self, manager):
        self.m = manager
        self.flush = SchedulerFlushWrapper(flush_cache=manager.flush_cache,
                                           is_fully_idle=manager.is_fully_idle,
                                           send_output=lambda out, req: None)

    async def flush_cache(self, timeout_s=None):
        return self.flush.handle(io_struct.FlushCacheReqInput(timeout_s=timeout_s))

    async def begin_weight_update(self, obj, request):
        out = self.m.begin_weight_update(obj)
        return out.success, out.message

    async def end_weight_update(self, obj, request):
        out = self.m.end_weight_update(obj)
        return out.success, out.message

    async def update_weights_from_tensor(self, obj, request):
        obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        out = self.m.update_weights_from_tensor(obj)
        return out.success, out.message

    def abort_request(self, rid="", abort_all=False):
        pass


def _engine_on(manager, monkeypatch, **server_args):
    tm = ManagerBackedTokenizerManager(manager)
    args = SimpleNamespace(tp_size=1, **server_args)
    monkeypatch.setattr(se, "sgl", SimpleNamespace(Engine=lambda **kw: SimpleNamespace(
        tokenizer_manager=tm, server_args=args)))
    return se.SGLangEngine("some/model", version=0, dtype="bfloat16")


def test_the_real_manager_refuses_an_update_outside_a_session(manager):
    m, runner, _ = manager
    obj = se.tensor_update_request({"w": torch.ones(2)}, 1, tp_size=1)
    out = m.update_weights_from_tensor(obj)
    assert not out.success and "begin_weight_update" in out.message and runner.loaded == []


def test_our_engine_updates_inside_a_session_the_real_manager_accepts(manager, monkeypatch):
    m, runner, versions = manager
    engine = _engine_on(m, monkeypatch)
    state = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 3)}
    for v in (1, 2):  # a second push opens a new session: the first one was closed
        m.scheduler.busy = 1  # an aborted request still in the scheduler's last batch
        info = asyncio.run(engine.update_weights(state, v))
        assert info["version"] == v and m.scheduler.busy == 0
    assert runner.calls == ["begin", ("end", False), "begin", ("end", False)]
    assert versions == ["1", "2"] and m._session is None
    assert all(torch.equal(loaded[k], t.to(torch.bfloat16)) for loaded in runner.loaded for k, t in state.items())


def test_the_real_manager_fails_an_update_that_flushes_while_busy(manager):
    """Why our updates go with flush_cache=False: with an aborted request still in the
    scheduler's batches, sglang's own flush fails the update (00a2ca2e asserted)."""
    m, runner, _ = manager
    m.begin_weight_update(io_struct.BeginWeightUpdateReqInput())
    m.scheduler.busy = 1
    obj = se.tensor_update_request({"w": torch.ones(2)}, 1, tp_size=1)
    obj.flush_cache = True
    obj.serialized_named_tensors = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
    out = m.update_weights_from_tensor(obj)
    assert not out.success and "cache was not flushed" in out.message
    m.end_weight_update(io_struct.EndWeightUpdateReqInput())


def test_the_real_manager_releases_memory_only_when_idle(manager):
    m, _, _ = manager
    m.scheduler.busy = 1
    with pytest.raises(AssertionError, match="only when server is idle"):
        m.release_memory_occupation(io_struct.ReleaseMemoryOccupationReqInput())


def test_our_engine_ends_a_session_left_open_before_the_next_begin(manager, monkeypatch):
    m, runner, _ = manager
    engine = _engine_on(m, monkeypatch)
    m.begin_weight_update(io_struct.BeginWeightUpdateReqInput())  # a cancelled push's begin
    engine._session_open = True
    asyncio.run(engine.update_weights({"w": torch.ones(2)}, 1))
    assert m._session is None and runner.calls[-1] == ("end", False) and len(runner.loaded) == 1


# ----------------------------------------------------------------- serializer, every weight path
def _child(payload, expected, q):
    from sglang.srt.utils import MultiprocessingSerializer
    try:
        got = dict(MultiprocessingSerializer.deserialize(payload))
        q.put(all(torch.equal(got[k], v) for k, v in expected.items()) and set(got) == set(expected))
    except BaseException as e:  # noqa: BLE001
        q.put(f"{type(e).__name__}: {e}")


def _roundtrip_in_child(state: dict, expected: dict):
    payload = MultiprocessingSerializer.serialize(se.named_tensors(state))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(payload, expected, q))
    p.start()
    res = q.get(timeout=120)
    p.join(30)
    return res


def test_shm_views_fail_in_the_real_serializer_and_ours_are_copied_first():
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    shm = SharedMemoryWeights("contract")
    try:
        views = read_shared(shm.write(sd.values(), manifest_of(sd.items())))
        with pytest.raises(OSError):
            MultiprocessingSerializer.serialize(list(views.items()))
        assert _roundtrip_in_child(views, sd) is True
    finally:
        shm.unlink()


def test_object_store_and_plain_tensors_roundtrip(ray_cluster):
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    assert _roundtrip_in_child(sd, sd) is True
    stored = state_from(ray_cluster.get(put_state(sd).ref))  # read-only object-store views
    assert _roundtrip_in_child(stored, sd) is True


# ----------------------------------------------------------------- LoRA (model.lora)
def test_lora_server_args_are_sglang_fields_of_the_right_types():
    from sglang.srt.arg_groups.fields.lora import Lora
    from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES

    from areal_ray.config.model import DEFAULT_LORA_TARGETS
    args = se.lora_server_args(8, DEFAULT_LORA_TARGETS, slots=4)
    assert set(args) <= {f.name for f in record_fields(ServerArgs)}
    assert set(args["lora_target_modules"]) <= set(SUPPORTED_LORA_TARGET_MODULES)
    lora = Lora(**args)  # sglang's own namespace of them
    assert (lora.enable_lora, lora.max_lora_rank, lora.max_loras_per_batch) == (True, 8, 5)
    assert lora.max_loaded_loras is None  # no LRU eviction by sglang: we unload ourselves
    # with no adapter at start, sglang needs the rank and the targets up front
    from sglang.srt.arg_groups import lora_hook
    src = inspect.getsource(lora_hook.check_lora_server_args)
    assert "cfg.lora_paths or (cfg.max_lora_rank and cfg.lora_target_modules)" in src
    assert args["max_lora_rank"] and args["lora_target_modules"]


@pytest.mark.parametrize("method", ["load_lora_adapter", "unload_lora_adapter"])
def test_lora_calls_are_coroutines_answering_success_and_a_message(method):
    fn = getattr(TokenizerManager, method)
    assert inspect.iscoroutinefunction(fn)
    assert list(inspect.signature(fn).parameters)[:2] == ["self", "obj"]
    fields = {f.name for f in record_fields(io_struct.LoRAUpdateOutput)}
    assert {"success", "error_message"} <= fields  # what _check_lora reads
    assert io_struct.LoadLoRAAdapterReqOutput is io_struct.UnloadLoRAAdapterReqOutput is io_struct.LoRAUpdateOutput


def test_lora_requests_are_the_real_classes_and_generate_takes_the_adapter_name():
    load = se.lora_load_request("areal-v3-3", "/dev/shm/adapter")
    assert isinstance(load, io_struct.LoadLoRAAdapterReqInput)
    assert (load.lora_name, load.lora_path, load.pinned) == ("areal-v3-3", "/dev/shm/adapter", False)
    unload = se.lora_unload_request("areal-v3-3")
    assert isinstance(unload, io_struct.UnloadLoRAAdapterReqInput) and unload.lora_name == "areal-v3-3"
    assert "lora_path" in inspect.signature(Engine.async_generate).parameters
    assert "lora_path=lora_path" in inspect.getsource(Engine.async_generate)
    obj = io_struct.GenerateReqInput(input_ids=[1, 2], sampling_params={}, lora_path="areal-v3-3")
    obj.normalize_batch_and_arguments()
    assert obj.lora_path == "areal-v3-3"  # one request: its adapter's name, as we sent it


def test_sglang_reads_our_peft_directory(tmp_path):
    """What `load_lora_adapter` reads at the path we give: sglang's LoRAConfig takes our
    adapter_config.json, and every tensor name carries its layer and lora_A / lora_B
    where sglang's loader looks for them."""
    from safetensors.torch import load_file
    from sglang.srt.layers.utils import get_layer_id
    from sglang.srt.lora.lora_config import LoRAConfig

    from areal_ray.rollout.engines.adapters import write_peft_dir
    from areal_ray.weights.adapter import Adapter
    from areal_ray.weights.payloads import AdapterMeta
    meta = AdapterMeta("tiny", "", 4, 8.0, 2.0, ("q_proj", "down_proj"))
    tensors = {f"model.layers.{i}.{m}.{h}": torch.zeros(4, 4)
               for i in (0, 1) for m in ("self_attn.q_proj", "mlp.down_proj") for h in ("lora_A", "lora_B")}
    path = write_peft_dir(Adapter(meta, tensors), tmp_path / "adapter")
    cfg = LoRAConfig(str(path))
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules)) == (4, 8.0, ["down_proj", "q_proj"])
    assert not cfg.use_dora and cfg.lora_added_tokens_size == 0
    names = list(load_file(str(path / "adapter_model.safetensors")))
    assert sorted(get_layer_id(n) for n in names) == [0] * 4 + [1] * 4
    assert sum("lora_A" in n for n in names) == sum("lora_B" in n for n in names) == 4


def test_each_load_is_a_new_cache_key_and_an_unload_waits_for_its_requests():
    """Why a new name per version never reuses a prefix cached under an older adapter:
    every load makes a LoRARef with a fresh lora_id, which a request's radix-cache key
    ends with. And sglang's registry makes an unload wait for the requests that use
    the adapter: ours only unloads an adapter none of our requests uses."""
    from sglang.srt.lora.lora_registry import LoRARef, LoRARegistry
    assert LoRARef(lora_name="a", lora_path="/p").lora_id != LoRARef(lora_name="a", lora_path="/p").lora_id
    from sglang.srt.managers.schedule_batch import Req
    src = inspect.getsource(Req.__init__)
    assert ") + lora_id  # lora_id is concatenated to the extra key" in src
    assert "self.extra_key = extra_key" in src

    async def scenario():
        registry = LoRARegistry()
        ref = LoRARef(lora_name="areal-v1-1", lora_path="/p")
        await registry.register(ref)
        lora_id = await registry.acquire("areal-v1-1")  # a request starts under it
        assert lora_id == ref.lora_id
        await registry.unregister("areal-v1-1")
        unload = asyncio.ensure_future(registry.wait_for_unload(lora_id))
        await asyncio.sleep(0.05)
        waited = not unload.done()
        await registry.release(lora_id)  # the request ended
        await asyncio.wait_for(unload, 5)
        return waited

    assert asyncio.run(scenario())


def test_the_serializer_moves_cpu_tensors_into_shared_memory_as_our_room_check_counts():
    """R3-C5: sglang's serializer shares each CPU tensor through torch's shared memory
    (/dev/shm), which is what `shared_bytes` counts and `tensor_update_request` checks
    room for; a CUDA tensor would go by CUDA IPC instead."""
    copies = se.named_tensors({"w": torch.ones(8)}, torch.bfloat16)
    assert not copies[0][1].is_shared()
    MultiprocessingSerializer.serialize(copies)
    assert copies[0][1].is_shared()
    assert se.shared_bytes(copies) == 16


def test_release_with_lora_keeps_sglangs_cpu_copy_of_the_weights():
    """R3-W1: `from_options` asks for enable_weights_cpu_backup with release_memory and
    LoRA; it is a server arg, and sglang's model loader hands it to the memory saver's
    weights region, which then restores the weights at resume."""
    from sglang.srt.model_executor.model_runner_components import load_model_utils
    args = {f.name: f for f in record_fields(ServerArgs)}
    assert args["enable_weights_cpu_backup"].default is False
    src = inspect.getsource(load_model_utils)
    assert "features.enable_weights_cpu_backup" in src
    assert "region(\n        GPU_MEMORY_TYPE_WEIGHTS,\n        enable_cpu_backup=enable_cpu_backup," in src


def test_sglang_spawns_its_scheduler_with_the_memory_savers_preload_from_our_environment():
    """R3-C2: the scheduler is a spawned process started inside the memory saver's
    `configure_subprocess` (LD_PRELOAD of its hook), so it inherits this process's
    environment at start: the LD_LIBRARY_PATH the engine sets before building sgl.Engine
    reaches the loader there."""
    from sglang.srt.entrypoints import engine as engine_module
    src = inspect.getsource(engine_module)
    assert 'mp.set_start_method("spawn", force=True)' in src
    assert "memory_saver_adapter.configure_subprocess()" in src
    start = src.index("memory_saver_adapter.configure_subprocess()")
    assert "proc.start()" in src[start:start + 300]


# ----------------------------------------------------------------- the load probe
def test_the_probe_request_is_one_sglang_accepts_and_its_prompt_logprobs_parse():
    """weights/probe.py on sglang: `score` asks `async_generate` for the prompt's
    logprobs from position 0 at temperature 1. sglang's scheduler prefixes them with
    None for the first token and keeps one id per prompt token (its logprob processor),
    and the tokenizer manager makes them (logprob, id, text) tuples: parsed here from
    sglang's own functions."""
    params = inspect.signature(Engine.async_generate).parameters
    assert {"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid",
            "lora_path"} <= set(params)
    sp = SamplingParams(**se.PROBE_PARAMS)
    sp.verify(vocab_size=1000)
    assert (sp.temperature, sp.top_p, sp.max_new_tokens) == (1.0, 1.0, 1)
    assert sp.top_k >= 1000  # -1: sglang's "the whole vocabulary"
    from sglang.srt.managers.scheduler_components import logprob_result_processor as lp
    assert "[None] + input_token_logprobs[:-1]" in inspect.getsource(lp)
    assert "origin_input_ids[req.logprob_start_len :]" in inspect.getsource(lp)
    ids, lps = [3, 7922, 15841], [-11.5, -9.25]
    tm = object.__new__(TokenizerManager)
    entries = tm.detokenize_logprob_tokens([None, *lps], ids, False)
    out = {"meta_info": {"input_token_logprobs": entries}}
    assert se.parse_prompt_logprobs(out, ids) == lps
    with pytest.raises(ValueError, match="2 prompt logprobs that do not match the 3-token probe"):
        se.parse_prompt_logprobs({"meta_info": {"input_token_logprobs": entries[1:]}}, ids)
