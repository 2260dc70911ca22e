"""SGLangEngine: the InferenceEngine protocol on sglang's in-process offline engine (GPUs).

`sgl.Engine` runs sglang's scheduler and detokenizer in subprocesses and its
TokenizerManager in this process. We send token ids (`skip_tokenizer_init=True`), one
request per `generate` call, and let sglang batch them. The engine's synchronous
methods (weight updates, flush) drive sglang's own event loop with
`run_until_complete`, which cannot be called from inside our running loop, so the
control calls go to the async coroutines of `engine.tokenizer_manager` with the
request structs from `sglang.srt.managers.io_struct` -- exactly what those sync
wrappers build and await.

Versions. Every token of a result carries the policy version it was sampled under,
and a result never mixes versions: weights change only while the admission gate is
closed and no request of ours is inside sglang. A request records the version when
it passes the gate; `pause("abort")` aborts the running ones (they return their
partial output with stop reason "abort") and `pause("wait")` lets them finish. We
keep our own gate (`AdmissionGate`, admission.py) instead of the TokenizerManager's
`pause_generation`: its "abort" mode holds a request that already passed our gate
inside sglang across the update (it would then run on the new weights under the old
version tag), and its
"retract"/"in_place" modes freeze running requests instead of letting them finish.

Behaviour logprobs. sglang returns, per output token, the logprob under
softmax(logits / temperature): temperature applied, top-k/top-p not applied to the
logprob (an older sampler renormalised by top-p, hence top_p=1 here; top_k=-1 and
min_p=0 also keep the sampled distribution the full one). Greedy is temperature 0,
which sglang turns into top_k=1 at temperature 1; its logprobs are then those of
the raw logits. The env var SGLANG_RETURN_ORIGINAL_LOGPROB (RETURN_ORIGINAL_LOGPROB
in older releases) switches to pre-temperature logprobs, which our trainer cannot
use, so the constructor refuses it.

Seeds. A request's `seed` goes out as sglang's `sampling_seed`, which sglang honours
only when the engine runs with `enable_deterministic_inference=True` (a server arg:
`rollout.engine_kwargs.enable_deterministic_inference=true`): then each row samples by
a Gumbel draw hashed from (its seed, its position), so the draw never depends on the
batch, and sglang switches to its batch-invariant kernels (attention, matmul, norms)
and the pytorch sampler. Without it the seed is ignored (sglang samples from one
generator for the batch): the engine warns once. Checked against the wheel's
SamplingParams and SamplingBatchInfo (tests/contract); not run on a GPU here.

Weight updates. sglang 0.5.23 loads tensors only inside a weight-update session:
`update_weights_from_tensor` answers success=False unless `begin_weight_update` ran
before it, and `end_weight_update` must follow (it finalises the runners' weights).
`update_weights_from_disk` needs no session. A failed load still ends its session, and
that end's own failure is attached to the load's error as a note, not raised in its
place. A push cancelled between begin and end can leave the session open, and sglang
refuses a nested begin (the 00a2ca2e scheduler asserts), so the engine remembers that a
session may be open and the next push ends it before its own begin. Tensors go to the
scheduler through sglang's MultiprocessingSerializer (torch's ForkingPickler): a CPU
tensor is shared by moving its storage into shared memory, which fails with OSError(9)
for a view of a file mapping (our `shm` weight path), so CPU tensors are first copied
into fresh memory, in the serving dtype (`named_tensors`). Sharing moves each CPU
storage into /dev/shm (torch's file-descriptor strategy; no disk fallback), so a push
first asks /dev/shm for room: one that does not fit whole goes in buckets of at most
SHM_BUCKET_BYTES, serialized during the pause, and one whose bucket does not fit fails
with an error naming /dev/shm and `--shm-size` (not ENOSPC or SIGBUS inside torch). A
push that fails while the gate waits for a load after `resume_memory` (below) records
the failure on the gate, so the health check fails and Serve replaces the replica
instead of leaving it closed. CUDA tensors go by CUDA IPC
when TP is 1; with TP > 1 every rank would open the handles on this process's GPU (a
CUDA context there and a cross-GPU copy each), so they go as CPU copies instead and each
rank copies to its own GPU. On the `collective` path the replica receives the buckets
through our own process group (`areal_ray.weights.encoding`); `update_weights_from_buckets`
loads each bucket as it arrives (one `update_weights_from_tensor` per bucket in one
session), so the replica holds a bucket or two instead of the whole model.
sglang's `update_weights_from_distributed` is not used (it expects its own rendezvous
and one broadcast per tensor).

Cache flush. A weight update must drop the prefix cache computed under the old weights,
but not through the update's own `flush_cache=True`: the scheduler flushes only when
fully idle (no running, last or in-flight batch), and a request we aborted can stay in
its batches for an iteration after its output has reached us. sglang then fails the
update (0.5.23) or asserts and dies, taking the Serve replica with it (00a2ca2e). So
updates go with flush_cache=False, and the engine asks `TokenizerManager.flush_cache`,
which answers success or failure, until it succeeds (FLUSH_TIMEOUT_S at most) before
the session ends and the gate reopens.

Memory. sglang sizes weights + KV cache to `mem_fraction_static` of each GPU; the rest
holds its CUDA graphs, activations and sampler, plus this process's own CUDA use (a
context, NCCL buffers and the received buckets on the collective path). The default
here is MEM_FRACTION_STATIC (0.7). After each swap the engine hands this process's
cached CUDA blocks back (`free_cuda_cache`). For a trainer sharing the GPU,
`release_memory`/`resume_memory` free and retake sglang's weights, KV cache and CUDA
graphs (sglang's memory saver: `enable_memory_saver=True`; its scheduler processes get
torch's CUDA runtime directory on LD_LIBRARY_PATH, `memory_saver_library_path`). A
release frees the weights; without sglang's CPU copy (`enable_weights_cpu_backup`) they
come back undefined and only a full load makes them good again, so with LoRA (pushes
are adapters only) `from_options` turns that copy on, and an adapter push onto
undefined base weights fails.

Bad requests. sglang refuses a prompt past its context but does not check token ids
against the vocabulary (0.5.23's TokenizerManager checks only `token_ids_logprob`): an
out-of-vocabulary id reaches the scheduler's embedding lookup and fails the batch it
is in (on CUDA a device-side assert, which the scheduler process does not survive).
`generate` first checks each request against the model sglang serves
(`RequestLimits`, limits.py: `model_config.vocab_size`, and `context_len` less the
tokens sglang reserves; a budget past the context is cut to it) and refuses a bad one
to its caller alone.

Aborts. TokenizerManager.abort_request(rid) sends an abort once per request and drops
one for a request it has not registered yet, and the scheduler drops an abort for a
request that has not reached it; either way that request would run to its end. So
the drain re-sends `abort_all` every ABORT_RETRY_S (with our gate closed every
request inside sglang is one we are draining).

LoRA (`model.lora`, `update_adapter`: adapters.py says how pushed adapters are served).
Built with `lora_rank`, the engine runs with sglang's LoRA on (`lora_server_args`:
`enable_lora`, `max_lora_rank`, the targets, `max_loras_per_batch` of the adapters
in use at once plus a base-only slot) and serves each pushed adapter under its own
name: written in peft's format and loaded with `TokenizerManager.load_lora_adapter`
before the pause, passed by name as each request's `lora_path`, unloaded with
`unload_lora_adapter` once no request of ours uses it. sglang keys its radix cache by
the adapter's `lora_id` (a fresh uuid per load), so no prefix cached under another
adapter is reused. Like vLLM, sglang adds the low-rank term apart from the base
matmul: not bit for bit the trainer's merged model. Not run on a GPU here: the
contract tier checks the calls, the request structs and that sglang's own LoRA
config reader takes our directory.

`tests/contract/` checks these calls against the real sglang wheel (`make test-contract`).

Read against sgl-project/sglang at commit 001067fffe33427bee0ed2f007fb7551a1d76b44:
python/sglang/srt/entrypoints/engine.py (Engine.__init__/async_generate/shutdown and
the sync wrappers), managers/tokenizer_manager.py (generate_request, abort_request,
pause_generation, _handle_batch_output/_handle_abort_req for the output dict),
managers/io_struct.py, server_args.py; plus tokenizer_control_mixin.py @ 00a2ca2e,
sampling/sampling_params.py @ 00c17caf and layers/sampler.py (@ 584f55d1 and a
recent copy) for the sampling and logprob semantics; and in the 0.5.23 wheel,
managers/scheduler_components/{weight_updater,flush_wrapper}.py, scheduler.py
(flush_cache, is_fully_idle) and tokenizer_control_mixin.py for the flush, the sessions
and the memory release.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import sys
import time
from collections.abc import AsyncIterable, Iterable, Mapping
from pathlib import Path

import torch

from areal_ray.rollout.engines.adapters import PAUSED_PUSH_SLOTS, AdapterServing
from areal_ray.rollout.engines.admission import AdmissionGate, GatedEngine
from areal_ray.rollout.engines.base import EngineOptions, GenerationRequest, GenerationResult
from areal_ray.rollout.engines.limits import RequestLimits
from areal_ray.weights.receivers import free_cuda_cache
from areal_ray.weights.staging import check_shm_room, shm_has_room

try:
    import sglang as sgl
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import MultiprocessingSerializer
except ImportError:  # CPU machines: the module still imports, the engine cannot be built
    sgl = io_struct = MultiprocessingSerializer = None

logger = logging.getLogger(__name__)

# sglang's finish_reason["type"] -> our STOP_REASONS ("stop" covers EOS, stop ids, stop strings).
FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}

# How often `abort_all` is re-sent while draining (see "Aborts" above).
ABORT_RETRY_S = 0.5

# How long the cache flush after a weight update waits for sglang's scheduler to be
# idle, and how often it asks (see "Cache flush" above).
FLUSH_TIMEOUT_S = 30.0
FLUSH_RETRY_S = 0.05

# The share of each GPU sglang's weights and KV cache get (see "Memory" above).
MEM_FRACTION_STATIC = 0.7

# The most a push puts into /dev/shm at once when the whole push does not fit there
# (see "Weight updates").
SHM_BUCKET_BYTES = 512 << 20

_ORIGINAL_LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")


# ----------------------------------------------------------------- pure shaping
def sampling_params(req: GenerationRequest) -> dict:
    """sglang sampling params for `req`: the full distribution at the request's temperature."""
    params = {"max_new_tokens": max(0, req.max_new_tokens), "ignore_eos": req.ignore_eos,
              "top_p": 1.0, "min_p": 0.0}
    if req.stop_ids:
        params["stop_token_ids"] = list(req.stop_ids)
    if req.temperature <= 0:
        params.update(temperature=0.0, top_k=1)
    else:
        params.update(temperature=float(req.temperature), top_k=-1)
    if req.seed is not None:  # used under enable_deterministic_inference (see "Seeds")
        params["sampling_seed"] = int(req.seed)
    return params


def parse_output(out: dict, version: int, budget: int, rid: str = "") -> GenerationResult:
    """A GenerationResult from one non-streaming `async_generate` output dict.

    Shape (skip_tokenizer_init, return_logprob=True): {"output_ids": [...], "meta_info":
    {"finish_reason": {"type": ..., ...}, "output_token_logprobs": [(logprob, token_id,
    None), ...], ...}}. A request aborted while still queued comes back with no tokens.
    """
    meta = out["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in FINISH_TYPES:
        raise ValueError(f"sglang request {rid!r} ended with an unknown finish reason {finish!r}")
    ids = [int(t) for t in out.get("output_ids") or []]
    entries = meta.get("output_token_logprobs") or []
    # A misaligned logprob would silently corrupt the importance weights: fail loudly.
    if len(entries) != len(ids) or any(int(e[1]) != t for e, t in zip(entries, ids)):
        raise ValueError(f"sglang request {rid!r}: {len(entries)} logprobs do not match "
                         f"{len(ids)} output tokens")
    if len(ids) > budget:
        raise ValueError(f"sglang request {rid!r} returned {len(ids)} tokens for a budget of {budget}")
    # A result that used its whole budget is "length" whatever ended it (as in HFEngine).
    reason = "length" if len(ids) >= budget else FINISH_TYPES[kind]
    return GenerationResult(ids, [float(e[0]) for e in entries], [version] * len(ids), reason,
                            rid, meta={"finish_reason": finish})


# The load probe (weights/probe.py) at the trainer's temperature, one token out: only the
# prompt's logprobs are read.
PROBE_PARAMS = {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def parse_prompt_logprobs(out: dict, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from an `async_generate` output asked with
    `return_logprob=True, logprob_start_len=0`: sglang's `input_token_logprobs` holds an
    entry (logprob, token id, text) per prompt token, the first with no logprob."""
    entries = out["meta_info"].get("input_token_logprobs") or []
    if len(entries) != len(ids) or [int(e[1]) for e in entries] != list(ids) \
            or entries[0][0] is not None or any(e[0] is None for e in entries[1:]):
        raise ValueError(f"sglang scored {len(entries)} prompt logprobs that do not match the "
                         f"{len(ids)}-token probe")
    return [float(e[0]) for e in entries[1:]]


def named_tensors(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                  dtype: torch.dtype | None = None, cpu: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for `update_weights_from_tensor`, from a state dict or from
    (name, tensor) pairs, in the serving dtype if given (halving what is shared for fp32
    trainers). CPU tensors are always copied: views of a file mapping (the shm path) or
    of read-only object-store memory cannot be moved into shared memory by the
    serializer. CUDA tensors go by CUDA IPC, copied only to cast, unless `cpu` asks for
    CPU copies (TP > 1, see "Weight updates")."""
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    out = []
    for name, t in pairs:
        t = t.detach()
        if cpu or t.device.type == "cpu":
            t = t.to(device="cpu", dtype=dtype or t.dtype, copy=True)
        elif dtype is not None:
            t = t.to(dtype)
        out.append((name, t))
    return out


def _pairs(tensors) -> Iterable[tuple[str, torch.Tensor]]:
    return tensors.items() if isinstance(tensors, Mapping) else tensors


def shared_bytes(tensors, dtype: torch.dtype | None = None, cpu: bool = False) -> int:
    """Bytes the serializer moves into shared memory for `tensors` (those `named_tensors`
    hands it as CPU tensors, in the serving dtype): what a push needs free in /dev/shm."""
    return sum(t.numel() * (dtype or t.dtype).itemsize for _, t in _pairs(tensors)
               if cpu or t.device.type == "cpu")


def shm_buckets(tensors, max_bytes: int, dtype: torch.dtype | None = None,
                cpu: bool = False) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) buckets of at most `max_bytes` of shared memory each
    (a larger tensor alone): a push serialized one bucket at a time."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in _pairs(tensors):
        n = shared_bytes([(name, t)], dtype, cpu)
        if not out or size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def tensor_update_request(tensors, version: int, tp_size: int,
                          dtype: torch.dtype | None = None):
    """The UpdateWeightsFromTensorReqInput that Engine.update_weights_from_tensor builds:
    one serialized payload per TP rank (each rank deserializes its own copy). The cache
    is flushed by the engine once the scheduler is idle (see "Cache flush"). Raises a
    clear OSError, before anything is shared, when /dev/shm has no room for the CPU
    tensors (torch would fail with ENOSPC, or the reader with SIGBUS)."""
    named = named_tensors(tensors, dtype, cpu=tp_size > 1)
    check_shm_room(shared_bytes(named), "sending weights to sglang's scheduler")
    payloads = [MultiprocessingSerializer.serialize(named) for _ in range(tp_size)]
    return io_struct.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=payloads, load_format=None, flush_cache=False,
        weight_version=str(version))


async def _aiter(items):
    for item in items:
        yield item


def disk_update_request(path: str, version: int):
    return io_struct.UpdateWeightFromDiskReqInput(model_path=path, load_format=None,
                                                  weight_version=str(version), flush_cache=False)


def cudart_dir(cuda_version: str | None, maps: Iterable[str] = (),
               path: list[str] | None = None) -> str | None:
    """The directory of the CUDA runtime (`libcudart.so.<major>`) of `cuda_version`
    (torch.version.cuda): the one this process mapped (lines of /proc/self/maps), else
    the one an installed nvidia-cuda-runtime distribution on `path` (default sys.path)
    ships. None without a CUDA version or a match."""
    if not cuda_version:
        return None
    lib = f"libcudart.so.{cuda_version.split('.')[0]}"

    def is_lib(name: str) -> bool:
        return name == lib or name.startswith(lib + ".")
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and is_lib(Path(fields[5].strip()).name):
            return str(Path(fields[5].strip()).parent)
    for dist in importlib.metadata.distributions(path=list(path if path is not None else sys.path)):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("nvidia-cuda-runtime"):
            for f in dist.files or ():
                if is_lib(f.name):
                    return str(Path(dist.locate_file(f)).parent)
    return None


def memory_saver_library_path(environ: Mapping[str, str] = os.environ) -> str | None:
    """LD_LIBRARY_PATH for sglang's scheduler processes under its memory saver: the
    current one with torch's CUDA runtime directory first (None: nothing to add).

    sglang starts each scheduler (spawn: a fresh exec) with torch_memory_saver's hook in
    LD_PRELOAD. The hook needs `libcudart.so.<major>` and carries no run path, and in a
    pip environment that library sits in site-packages, where the loader does not look:
    the scheduler dies at exec (exit 127; sglang#36533, fixed in torch_memory_saver
    after 0.0.10). The variable is read at that exec, so setting it in this process
    before sglang spawns is enough, and it is found on the replica's own node."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.readlines()
    except OSError:
        maps = []
    found = cudart_dir(torch.version.cuda, maps)
    current = [d for d in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    if found is None or found in current:
        return None
    return os.pathsep.join([found, *current])


def original_logprob_env() -> str | None:
    """The name of a set env var that makes sglang return pre-temperature logprobs, if any."""
    for name in _ORIGINAL_LOGPROB_ENV:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def engine_limits(engine) -> RequestLimits:
    """What `engine` (an sgl.Engine) takes: the vocabulary of its model config, and its
    context less the tokens its TokenizerManager reserves (it refuses a prompt plus
    budget past `context_len` counting those)."""
    tm = engine.tokenizer_manager
    return RequestLimits(tm.model_config.vocab_size,
                         tm.context_len - getattr(tm, "num_reserved_tokens", 0))


def _check(result, what: str) -> None:
    # TokenizerManager weight calls answer (success, message[, ...]).
    if not result[0]:
        raise RuntimeError(f"sglang {what} failed: {result[1]}")


def lora_server_args(rank: int, targets, slots: int = PAUSED_PUSH_SLOTS) -> dict:
    """Server args for serving pushed adapters of `rank` on `targets` (none when 0: LoRA
    off), `slots` of them in use at once. sglang counts a base-only request as one of
    `max_loras_per_batch` (requests before the first push run on the base)."""
    if rank <= 0:
        return {}
    return dict(enable_lora=True, max_lora_rank=rank, lora_target_modules=sorted(set(targets)),
                max_loras_per_batch=slots + 1)


def lora_load_request(name: str, path: str):
    return io_struct.LoadLoRAAdapterReqInput(lora_name=name, lora_path=path)


def lora_unload_request(name: str):
    return io_struct.UnloadLoRAAdapterReqInput(lora_name=name)


def _check_lora(out, what: str) -> None:
    # TokenizerManager's LoRA calls answer a LoRAUpdateOutput (success, error_message).
    if not out.success:
        raise RuntimeError(f"sglang {what} failed: {out.error_message}")


# ----------------------------------------------------------------- the engine
class SGLangEngine(AdapterServing, GatedEngine):
    streams_buckets = True  # a broadcast goes into sglang bucket by bucket
    engine_name = "sglang"  # names its adapter directories

    def __init__(self, model_path: str, version: int = 0,
                 mem_fraction_static: float | None = MEM_FRACTION_STATIC, dtype: str = "bfloat16",
                 enable_memory_saver: bool = False, lora_rank: int = 0,
                 lora_targets: tuple[str, ...] = (), lora_slots: int = PAUSED_PUSH_SLOTS,
                 owner: str = "", **engine_kwargs):
        """`enable_memory_saver` turns on sglang's memory saver, which `release_memory`
        needs (it costs little: sglang then allocates weights and KV cache through it).
        `lora_rank` > 0 (model.lora) serves pushed adapters on `lora_targets`."""
        if sgl is None:
            raise ImportError("SGLangEngine needs sglang, which runs on GPU machines only: "
                              "pip install -r requirements-gpu.txt (instead of requirements.txt)")
        env = original_logprob_env()
        if env:
            raise ValueError(f"{env} makes sglang return logprobs before temperature; the "
                             "trainer needs those of the distribution sampled from. Unset it.")
        if enable_memory_saver:
            engine_kwargs["enable_memory_saver"] = True
        if engine_kwargs.get("enable_memory_saver"):
            library_path = memory_saver_library_path()
            if library_path:  # kept for the replica's life: sglang's processes inherit it
                os.environ["LD_LIBRARY_PATH"] = library_path
        engine_kwargs = {**lora_server_args(lora_rank, lora_targets, lora_slots), **engine_kwargs}
        self.engine = sgl.Engine(model_path=model_path, dtype=dtype,
                                 mem_fraction_static=mem_fraction_static,
                                 skip_tokenizer_init=True, **engine_kwargs)
        self.limits = engine_limits(self.engine)
        self.torch_dtype = getattr(torch, dtype, None) if dtype != "auto" else None
        self.deterministic = bool(engine_kwargs.get("enable_deterministic_inference"))
        self._warned_seed = False
        self.gate = AdmissionGate(version, ABORT_RETRY_S)
        self._stats = {"tokens": 0, "aborted_requests": 0}
        self._lock = asyncio.Lock()  # one weight load or memory release/resume at a time
        self._session_open = False  # a weight-update session may be open in sglang
        self._released = False  # sglang's GPU memory is released (release_memory)
        self._reopen_after_load = False  # resumed without the weights: the next load reopens
        self.model_path, self.dtype, self.owner = model_path, dtype, owner  # adapters' base check
        self._init_lora()

    @classmethod
    def from_options(cls, model_path: str, opts: EngineOptions) -> SGLangEngine:
        kwargs = dict(opts.engine_kwargs)
        if opts.release_memory:  # the memory saver is chosen when the engine is built
            kwargs.setdefault("enable_memory_saver", True)
        if opts.release_memory and opts.lora_rank > 0:
            # Pushes are adapters only, applied to base weights that a release frees: without
            # sglang's CPU copy they come back from resume_memory undefined.
            if not kwargs.setdefault("enable_weights_cpu_backup", True):
                raise ValueError(
                    "rollout.release_memory with model.lora on sglang needs "
                    "enable_weights_cpu_backup (its base weights are freed at each release and "
                    "only a CPU copy restores them): drop "
                    "rollout.engine_kwargs.enable_weights_cpu_backup=false")
        return cls(model_path, dtype=opts.dtype, lora_rank=opts.lora_rank,
                   lora_targets=opts.lora_targets, lora_slots=opts.lora_slots,
                   owner=opts.owner, **kwargs)

    @property
    def _tm(self):
        return self.engine.tokenizer_manager

    @property
    def _tp_size(self) -> int:
        return self.engine.server_args.tp_size

    # ----------------------------------------------------------------- generation
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        req = self.limits.admit(req)
        budget = req.max_new_tokens
        if budget == 0:
            return GenerationResult([], [], [], "length", req.rid)
        if req.seed is not None and not self.deterministic and not self._warned_seed:
            self._warned_seed = True
            logger.warning("sglang ignores request seeds unless rollout.engine_kwargs."
                           "enable_deterministic_inference=true: sampling is not reproducible")
        # sglang aborts by rid prefix; the gate's ids start with a fresh uuid.
        async with self.gate.admitted(budget, req.rid) as (rid, version):
            lora_id = self.slots.acquire()  # no await since admission: `version`'s adapter
            try:
                out = await self.engine.async_generate(
                    input_ids=list(req.input_ids), sampling_params=sampling_params(req),
                    return_logprob=True, logprob_start_len=-1, rid=rid,
                    lora_path=self._lora.get(lora_id))
            except asyncio.CancelledError:
                self._tm.abort_request(rid=rid)  # the caller is gone: free the GPU work
                raise
            finally:
                self.slots.release(lora_id)
        if lora_id is not None and lora_id != self.slots.current:
            await self._unload_unused()  # the last request of an older adapter may be this
        res = parse_output(out, version, budget, req.rid)
        self._stats["tokens"] += len(res.output_ids)
        self._stats["aborted_requests"] += res.stop_reason == "abort"
        return res

    async def score(self, ids: list[int]) -> list[float]:
        """The load probe's logprobs (weights/probe.py): sglang's prompt logprobs through
        the gate, under the version's adapter, as a generation would see the weights."""
        async with self.gate.admitted(1, "probe") as (rid, _):
            lora_id = self.slots.acquire()
            try:
                out = await self.engine.async_generate(
                    input_ids=list(ids), sampling_params=dict(PROBE_PARAMS),
                    return_logprob=True, logprob_start_len=0, rid=rid,
                    lora_path=self._lora.get(lora_id))
            except asyncio.CancelledError:
                self._tm.abort_request(rid=rid)
                raise
            finally:
                self.slots.release(lora_id)
        return parse_prompt_logprobs(out, ids)

    async def _abort(self, rids: list[str]) -> None:
        # The gate is closed: everything inside sglang is ours and being drained.
        self._tm.abort_request(abort_all=True)

    # ----------------------------------------------------------------- weights
    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        """Load tensors in memory (CPU or CUDA) through sglang's serializer. The copy and
        serialization happen before the pause, off the event loop, while generation goes
        on; when /dev/shm cannot hold the whole push, bucket by bucket during the pause."""
        return await self._failing_blind(version, self._update_from_memory(state_dict, version, mode))

    async def _update_from_memory(self, state_dict: dict, version: int, mode: str) -> dict:
        cpu = self._tp_size > 1
        if not shm_has_room(shared_bytes(state_dict, self.torch_dtype, cpu)):
            buckets = shm_buckets(state_dict, SHM_BUCKET_BYTES, self.torch_dtype, cpu)
            # Refused before the pause when not even the largest bucket fits.
            check_shm_room(max(shared_bytes(b, self.torch_dtype, cpu) for b in buckets),
                           "sending weights to sglang's scheduler")
            return await self.update_weights_from_buckets(_aiter(buckets), version, mode)
        obj = await asyncio.to_thread(tensor_update_request, state_dict, version,
                                      self._tp_size, self.torch_dtype)
        return await self._update_weights(version, mode, lambda: self._in_session(
            lambda: self._load_tensors(obj)))

    async def update_weights_from_buckets(
            self, buckets: AsyncIterable[Iterable[tuple[str, torch.Tensor]]], version: int,
            mode: str = "abort") -> dict:
        """Load (name, tensor) buckets as they arrive, one `update_weights_from_tensor`
        each, all in one session: a replica receiving a broadcast (`CollectiveReceiver.
        stream`) then holds a bucket or two instead of the whole model. The buckets are
        taken after the pause, so a receiver that needs the sender (a broadcast) makes
        the pause last the transfer; each bucket is dropped once sglang has loaded it."""
        async def load():
            async for bucket in buckets:
                obj = await asyncio.to_thread(tensor_update_request, bucket, version,
                                              self._tp_size, self.torch_dtype)
                await self._load_tensors(obj)
                del bucket, obj

        try:
            return await self._failing_blind(version, self._update_weights(
                version, mode, lambda: self._in_session(load)))
        finally:  # a load that failed half way leaves a receiver's broadcast to close
            if hasattr(buckets, "aclose"):
                await buckets.aclose()

    async def update_weights_from_disk(self, path: str, version: int, mode: str = "abort") -> dict:
        """Load a HF checkpoint directory written by the trainer (no session needed)."""
        async def load():
            _check(await self._tm.update_weights_from_disk(disk_update_request(path, version), None),
                   "update_weights_from_disk")
            await self._flush_cache()
        return await self._failing_blind(version, self._update_weights(version, mode, load))

    async def update_adapter(self, adapter, version: int, mode: str = "abort") -> dict:
        return await self._failing_blind(version, super().update_adapter(adapter, version, mode))

    async def _failing_blind(self, version: int, update) -> dict:
        """Await a weight or adapter update; if it fails while the gate waits for a load
        to reopen it (resumed without the weights), record the failure on the gate. An
        error before the swap (copying, serializing, writing an adapter, a cancellation)
        would otherwise leave the replica closed but healthy: nothing served and nothing
        replaced it. A recorded failure fails the health check, so Serve replaces it."""
        try:
            return await update
        except BaseException as e:
            if self._reopen_after_load:
                self.gate.fail(f"loading v{version}", e)
            raise

    async def _update_weights(self, version: int, mode: str, load) -> dict:
        """`_update` of full weights: no adapter serves after them (adapters.py)."""
        async def plain():
            self._serve_plain_weights()
            await load()
        info = await self._update(version, mode, plain)
        await self._unload_unused()
        return info

    # ----------------------------------------------------------------- LoRA hooks
    def _check_lora_enabled(self) -> None:
        if not getattr(self.engine.server_args, "enable_lora", False):
            raise RuntimeError("this sglang engine was built without LoRA: the replica passes "
                               "model.lora.rank as lora_rank (enable_lora)")

    async def _add_lora(self, lora_id: int, name: str, path) -> str:
        _check_lora(await self._tm.load_lora_adapter(lora_load_request(name, str(path)), None),
                    "load_lora_adapter")
        return name  # requests name the adapter by it (`lora_path`)

    async def _remove_lora(self, lora_id: int, name) -> None:
        _check_lora(await self._tm.unload_lora_adapter(lora_unload_request(name), None),
                    "unload_lora_adapter")

    async def _activate(self, version: int, mode: str, activate) -> dict:
        if self._reopen_after_load:  # the base weights came back undefined (resume_memory)
            raise RuntimeError(
                "sglang's base weights came back from resume_memory undefined (no "
                "enable_weights_cpu_backup): an adapter alone cannot be served on them")
        return await self._update(version, mode, activate)

    async def _load_tensors(self, obj) -> None:
        _check(await self._tm.update_weights_from_tensor(obj, None), "update_weights_from_tensor")

    async def _update(self, version: int, mode: str, load) -> dict:
        """The gate's swap around `load()`, refused while sglang's memory is released
        (the weights' memory is not there to write to); the replica's cached CUDA blocks
        are handed back afterwards."""
        async with self._lock:
            if self._released:
                raise RuntimeError("sglang's GPU memory is released: call resume_memory() "
                                   "before loading weights")
            try:
                info = await self._swap(version, mode, load)
            finally:
                free_cuda_cache()
            if self._reopen_after_load:  # resumed without its weights: now they are loaded
                self._reopen_after_load = False
                await self.resume()
            return info

    async def _in_session(self, load) -> None:
        """`load()` and the cache flush between begin_weight_update and end_weight_update.
        The session is ended even when the load fails or is cancelled, so the next push
        can open one; the load's error is the one raised."""
        await self._begin_session()
        try:
            await load()
            await self._flush_cache()
        except BaseException as e:
            await self._end_session_after(e)
            raise
        await self._end_session()

    async def _begin_session(self) -> None:
        """Open a weight-update session, first ending one a cancelled push may have left
        open (sglang refuses a nested begin). The flag is set before the call: a begin
        is sent as soon as its coroutine starts, so one cancelled while awaiting the
        answer still opens the session in the scheduler."""
        if self._session_open:
            # Not checked: if that begin failed there is no session to end, and sglang says so.
            await self._tm.end_weight_update(io_struct.EndWeightUpdateReqInput(), None)
            self._session_open = False
        self._session_open = True
        _check(await self._tm.begin_weight_update(io_struct.BeginWeightUpdateReqInput(), None),
               "begin_weight_update")

    async def _end_session(self) -> None:
        _check(await self._tm.end_weight_update(io_struct.EndWeightUpdateReqInput(), None),
               "end_weight_update")
        self._session_open = False

    async def _end_session_after(self, error: BaseException) -> None:
        """End the session after a failed load; an end that fails too is attached to the
        load's error (the cause worth reporting), not raised in its place."""
        try:
            await self._end_session()
        except Exception as end_error:  # noqa: BLE001 - reported with the load's error
            error.add_note(f"then ending the weight-update session failed too: "
                           f"{type(end_error).__name__}: {end_error}")

    async def _flush_cache(self) -> None:
        """Flush sglang's cache once its scheduler is fully idle (see "Cache flush").
        Our gate is closed, so every request inside sglang is one being drained: each
        retry re-sends abort_all, which also ends a request whose caller went away and
        whose own abort overtook it."""
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while True:
            out = await self._tm.flush_cache()
            if out.success:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"sglang's scheduler was still busy after FLUSH_TIMEOUT_S={FLUSH_TIMEOUT_S}s "
                    f"with our gate closed, so its cache could not be flushed: "
                    f"{out.message or 'no reason given'}")
            self._tm.abort_request(abort_all=True)
            await asyncio.sleep(FLUSH_RETRY_S)

    # ----------------------------------------------------------------- memory
    async def release_memory(self) -> None:
        """Free the GPU memory sglang holds (weights, KV cache, CUDA graphs) for a
        trainer on the same GPU; `resume_memory` takes it back.

        Pauses first ("abort": running requests return their partial output) and leaves
        the gate closed: a request reaching sglang while its memory is released would
        run on freed memory, and sglang releases only when its scheduler is fully idle
        (it asserts that), hence the flush (which waits for idle) just before."""
        if not getattr(self.engine.server_args, "enable_memory_saver", False):
            raise RuntimeError("release_memory needs sglang's memory saver: build the engine "
                               "with enable_memory_saver=True "
                               "(rollout.engine_kwargs.enable_memory_saver=true)")
        async with self._lock:
            if self._released:
                return
            await self.pause("abort")
            await self._flush_cache()
            await self._tm.release_memory_occupation(
                io_struct.ReleaseMemoryOccupationReqInput(tags=None), None)
            self._released = True

    async def resume_memory(self) -> None:
        """Take sglang's GPU memory back and reopen the gate. Without sglang's CPU backup
        of the weights (server arg enable_weights_cpu_backup) their memory comes back
        with undefined contents: the gate then stays closed until the next weight load,
        which reopens it."""
        async with self._lock:
            if self._released:
                await self._tm.resume_memory_occupation(
                    io_struct.ResumeMemoryOccupationReqInput(tags=None), None)
                self._released = False
                self._reopen_after_load = not getattr(
                    self.engine.server_args, "enable_weights_cpu_backup", False)
            if not self._reopen_after_load:
                await self.resume()

    # ----------------------------------------------------------------- state
    def load(self) -> dict:
        return {**self.gate.load(), "busy_s": self.gate.busy_s(), **self._stats}

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._remove_lora_dirs()
