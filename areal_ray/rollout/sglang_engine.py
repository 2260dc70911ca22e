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
`update_weights_from_disk` needs no session. Tensors go to the scheduler through
sglang's MultiprocessingSerializer (torch's ForkingPickler): a CPU tensor is shared
by moving its storage into shared memory, which fails with OSError(9) for a view of
a file mapping (our `shm` weight path), so CPU tensors are first copied into fresh
memory, in the serving dtype (`named_tensors`). On the `collective` path the replica
receives the buckets through our own process group (`areal_ray.weights`) and hands
the tensors over the same way; sglang's `update_weights_from_distributed` is not
used (it expects its own rendezvous and one broadcast per tensor).

Aborts. TokenizerManager.abort_request(rid) sends an abort once per request and drops
one for a request it has not registered yet, and the scheduler drops an abort for a
request that has not reached it; either way that request would run to its end. So
the drain re-sends `abort_all` every ABORT_RETRY_S (with our gate closed every
request inside sglang is one we are draining).

`tests/contract/` checks these calls against the real sglang wheel (`make test-contract`).

Read against sgl-project/sglang at commit 001067fffe33427bee0ed2f007fb7551a1d76b44:
python/sglang/srt/entrypoints/engine.py (Engine.__init__/async_generate/shutdown and
the sync wrappers), managers/tokenizer_manager.py (generate_request, abort_request,
pause_generation, _handle_batch_output/_handle_abort_req for the output dict),
managers/io_struct.py, server_args.py; plus tokenizer_control_mixin.py @ 00a2ca2e,
sampling/sampling_params.py @ 00c17caf and layers/sampler.py (@ 584f55d1 and a
recent copy) for the sampling and logprob semantics.
"""

from __future__ import annotations

import asyncio
import logging
import os

import torch

from areal_ray.rollout.admission import AdmissionGate, GatedEngine
from areal_ray.rollout.engine import GenerationRequest, GenerationResult

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


def named_tensors(state_dict: dict, dtype: torch.dtype | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs for `update_weights_from_tensor`, in the serving dtype if given
    (halving what is shared for fp32 trainers). CPU tensors are always copied: views of
    a file mapping (the shm path) or of read-only object-store memory cannot be moved
    into shared memory by the serializer. CUDA tensors go by CUDA IPC, copied only to cast."""
    out = []
    for name, t in state_dict.items():
        t = t.detach()
        if t.device.type == "cpu":
            t = t.to(dtype=dtype or t.dtype, copy=True)
        elif dtype is not None:
            t = t.to(dtype)
        out.append((name, t))
    return out


def tensor_update_request(state_dict: dict, version: int, tp_size: int,
                          dtype: torch.dtype | None = None):
    """The UpdateWeightsFromTensorReqInput that Engine.update_weights_from_tensor builds:
    one serialized payload per TP rank (each rank deserializes its own copy)."""
    tensors = named_tensors(state_dict, dtype)
    payloads = [MultiprocessingSerializer.serialize(tensors) for _ in range(tp_size)]
    return io_struct.UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=payloads, load_format=None, flush_cache=True,
        weight_version=str(version))


def disk_update_request(path: str, version: int):
    return io_struct.UpdateWeightFromDiskReqInput(model_path=path, load_format=None,
                                                  weight_version=str(version))


def original_logprob_env() -> str | None:
    """The name of a set env var that makes sglang return pre-temperature logprobs, if any."""
    for name in _ORIGINAL_LOGPROB_ENV:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


def _check(result, what: str) -> None:
    # TokenizerManager weight calls answer (success, message[, ...]).
    if not result[0]:
        raise RuntimeError(f"sglang {what} failed: {result[1]}")


# ----------------------------------------------------------------- the engine
class SGLangEngine(GatedEngine):
    def __init__(self, model_path: str, version: int = 0, mem_fraction_static: float | None = None,
                 dtype: str = "bfloat16", **engine_kwargs):
        if sgl is None:
            raise ImportError("SGLangEngine needs sglang, which runs on GPU machines only: "
                              "pip install -r requirements-gpu.txt (instead of requirements.txt)")
        env = original_logprob_env()
        if env:
            raise ValueError(f"{env} makes sglang return logprobs before temperature; the "
                             "trainer needs those of the distribution sampled from. Unset it.")
        self.engine = sgl.Engine(model_path=model_path, dtype=dtype,
                                 mem_fraction_static=mem_fraction_static,
                                 skip_tokenizer_init=True, **engine_kwargs)
        self.torch_dtype = getattr(torch, dtype, None) if dtype != "auto" else None
        self.deterministic = bool(engine_kwargs.get("enable_deterministic_inference"))
        self._warned_seed = False
        self.gate = AdmissionGate(version, ABORT_RETRY_S)
        self._stats = {"tokens": 0, "aborted_requests": 0}

    @property
    def _tm(self):
        return self.engine.tokenizer_manager

    # ----------------------------------------------------------------- generation
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        budget = max(0, req.max_new_tokens)
        if budget == 0:
            return GenerationResult([], [], [], "length", req.rid)
        if req.seed is not None and not self.deterministic and not self._warned_seed:
            self._warned_seed = True
            logger.warning("sglang ignores request seeds unless rollout.engine_kwargs."
                           "enable_deterministic_inference=true: sampling is not reproducible")
        # sglang aborts by rid prefix; the gate's ids start with a fresh uuid.
        async with self.gate.admitted(budget, req.rid) as (rid, version):
            try:
                out = await self.engine.async_generate(
                    input_ids=list(req.input_ids), sampling_params=sampling_params(req),
                    return_logprob=True, logprob_start_len=-1, rid=rid)
            except asyncio.CancelledError:
                self._tm.abort_request(rid=rid)  # the caller is gone: free the GPU work
                raise
        res = parse_output(out, version, budget, req.rid)
        self._stats["tokens"] += len(res.output_ids)
        self._stats["aborted_requests"] += res.stop_reason == "abort"
        return res

    async def _abort(self, rids: list[str]) -> None:
        # The gate is closed: everything inside sglang is ours and being drained.
        self._tm.abort_request(abort_all=True)

    # ----------------------------------------------------------------- weights
    async def _in_session(self, call, obj, what: str) -> None:
        """`call(obj)` between begin_weight_update and end_weight_update; the session is
        closed even when the load fails, so the next push can open one."""
        _check(await self._tm.begin_weight_update(io_struct.BeginWeightUpdateReqInput(), None),
               "begin_weight_update")
        try:
            _check(await call(obj, None), what)
        finally:
            _check(await self._tm.end_weight_update(io_struct.EndWeightUpdateReqInput(), None),
                   "end_weight_update")

    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        """Load tensors in memory (CPU or CUDA) through sglang's serializer. The copy and
        serialization happen before the pause, off the event loop, while generation goes on."""
        obj = await asyncio.to_thread(tensor_update_request, state_dict, version,
                                      self.engine.server_args.tp_size, self.torch_dtype)

        async def load():
            await self._in_session(self._tm.update_weights_from_tensor, obj,
                                   "update_weights_from_tensor")
        return await self._swap(version, mode, load)

    async def update_weights_from_disk(self, path: str, version: int, mode: str = "abort") -> dict:
        """Load a HF checkpoint directory written by the trainer (no session needed)."""
        async def load():
            _check(await self._tm.update_weights_from_disk(disk_update_request(path, version), None),
                   "update_weights_from_disk")
        return await self._swap(version, mode, load)

    # ----------------------------------------------------------------- state
    def load(self) -> dict:
        return {**self.gate.load(), "busy_s": self.gate.busy_s(), **self._stats}

    def shutdown(self) -> None:
        self.engine.shutdown()
