"""HFEngine: a continuous-batching, interruptible inference engine on transformers.

A scheduler thread owns the model and the running rows, held in a few *cohorts*
(`KVBatch`: one left-padded KV cache each). Every iteration it admits waiting
requests (prefilled together as a new cohort, merged into one of similar width),
runs one decode step per cohort, and retires the rows that hit EOS or their budget,
so a short request never waits for a long one and a new one never waits for a batch
to drain. Cohorts exist because every row attends over its cohort's full width: a
wave of short requests merged next to a long generation would pay for the long one's
length on every step. Finished rows are answered at once but compacted out of the
cache only once a quarter of a cohort is dead (compaction copies the cache).
`batching="static"` admits only into an empty batch: the classic batch-at-a-time
engine, kept for the benchmark.

Reproducibility (docs/reproducibility.md). A request with a `seed` samples from its own
`torch.Generator` seeded with it, one draw per token from its own row of
probabilities, so its random draws never depend on other requests (rows without a
seed share the engine's global generator, as before). Its *numerics* are another
matter. In `continuous` (and `static`) batching a row's logits depend on what else
runs: its cohort's width, and so the left padding in front of it, is set by the
longest row it was prefilled or merged with, and a padded forward (masked columns,
other shapes for the attention and matmul kernels) gives logits that differ from the
unpadded ones in the last bits (measured: up to 2.4e-6 with 5 pad columns, float32
CPU). So the same seeded request gives the same tokens and logprobs only up to that
noise, and one near-tie draw that flips puts the rest of the sample on another path.
`batching="invariant"` removes the dependency: every request is its own cohort
(prefilled alone, never merged, decoded by its own forward per step, so no padding
and every kernel sees the same shapes as when it runs alone). With a seed its tokens
and logprobs are then bit-identical alone, among any other traffic, and across an
abort + resubmission at the same point. It costs one forward per running request per
step instead of one per cohort: 0.17x the tokens/s of `continuous` on the embedded
model on CPU (benchmarks/bench_repro.py, docs/reproducibility.md). Batching rows of equal
length without padding was tried and is not enough: the CPU kernels are not
batch-size-invariant either.

Why not transformers' own continuous-batching manager: its `pause()` lets weights be
swapped under running sequences, which would mix versions inside a sequence's KV
cache without a record of where, and `stop()` ends the manager; on CPU each of its
steps also cost ~15 ms of fixed overhead, 3-7x slower than plain batched decoding
for our tiny models (docs/stack_facts.md).

Weight updates pause the scheduler between two steps: mode "abort" ends every running
request at once with its partial output (stop reason "abort"; the client resubmits
prompt + partial output, whose KV cache is recomputed under the new weights), mode
"wait" holds new requests back until the running ones finish. Weights change only
while no request runs, so every token carries the exact version that produced it.

LoRA adapters (`update_adapter`, `model.lora`) load the same way: paused, each adapted
module's weight is recomputed as base + (B @ A) * scaling (weights/adapter.py, the
trainer's own merge, so the weights are bit-identical to its merged model) from a copy
of the base weights taken before the first adapter, so adapters never stack. The copy
costs the adapted modules' weights once more (most of a decoder's parameters); its
digest is checked against the one the trainer computed of its base, so an adapter is
never applied to another model. A full `update_weights` makes its weights the new base.

Memory (one GPU shared with the trainer): `release_memory` pauses with abort, which
drops every cohort's KV cache, keeps new requests waiting, and hands the cached blocks
back to CUDA (`torch.cuda.empty_cache`), so the trainer can use them; the weights stay
on the device. `resume_memory` reopens. A weight update in between keeps it closed.

Behaviour logprobs are those of the distribution sampled from: the full softmax of
logits / temperature, no top-k/top-p (greedy requests use temperature 1), so a
teacher-forced pass reproduces them.

Failures stay with the request that causes them. `generate` refuses what the model
cannot take (`RequestLimits`, limits.py: ids outside the vocabulary, a prompt past the
context; a budget past it is cut to it) before the request reaches a batch. A forward
or a draw that still raises fails only its own rows: a prefill chunk that raises is
prefilled again row by row, and a cohort's decode step that raises is rolled back
(the columns it appended to the KV cache and mask are cut off) and run again row by
row, each row as its own cohort. A row that fails alone ends with its error; the
others go on, merged again into cohorts after the step. Without that, one bad
request (say an out-of-vocabulary id from an agent) ended every running rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM

from areal_ray.config.choices import Batching
from areal_ray.rollout.engines.base import (
    EngineOptions,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    check_pause_mode,
)
from areal_ray.rollout.engines.kv_batch import KVBatch, new_cache
from areal_ray.rollout.engines.limits import RequestLimits
from areal_ray.task.tokenizer import load_tokenizer
from areal_ray.weights.adapter import Adapter, base_digest, merge_weight
from areal_ray.weights.encoding import digest


@dataclass
class _Row:
    req: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # of a seeded request, made at its first draw

    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.out)

    def finished(self, eos_id: int) -> str | None:
        if self.out and ((self.out[-1] == eos_id and not self.req.ignore_eos)
                         or self.out[-1] in self.req.stop_ids):
            return "stop"
        return "length" if self.remaining() <= 0 else None

    def resolve(self, reason: str | None = None, error: Exception | None = None) -> None:
        res = None if error else GenerationResult(self.out, self.logprobs, self.versions,
                                                  reason, self.req.rid)
        self.loop.call_soon_threadsafe(_settle, self.future, res, error)


def _settle(fut: asyncio.Future, res, error) -> None:
    if not fut.done():  # the caller may have cancelled
        fut.set_exception(error) if error else fut.set_result(res)


class HFEngine(InferenceEngine):
    def __init__(self, model_path: str, max_batch_size: int = 64, device: str = "cpu",
                 dtype: str = "float32", version: int = 0, batching: str = "continuous",
                 max_cohorts: int = 4, merge_ratio: float = 0.5,
                 prefill_tokens: int = 4096, max_model_len: int | None = None):
        """`max_model_len`: the context a request's prompt and budget must fit (default:
        the model's max_position_embeddings)."""
        if batching not in Batching.values():
            raise ValueError(f"batching {batching!r} is not one of {Batching.values()}")
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        text_cfg = self.model.config.get_text_config(decoder=True)
        kinds = getattr(text_cfg, "layer_types", None) or []
        if getattr(text_cfg, "sliding_window", None) or any(k != "full_attention" for k in kinds):
            raise NotImplementedError("HFEngine batches rows in one full-attention KV cache; "
                                      "sliding-window attention is not supported")
        self.num_layers = text_cfg.num_hidden_layers
        self.limits = RequestLimits.from_config(self.model.config, max_model_len)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.max_batch_size = max_batch_size
        self._min_join = max(1, max_batch_size // 8)
        self.batching = batching
        self.version = version
        self._cv = threading.Condition()
        self._waiting: deque[_Row] = deque()  # guarded by _cv
        self._pause_mode: str | None = None  # guarded by _cv
        self._pause_waiters: list[concurrent.futures.Future] = []  # guarded by _cv
        self._closed = False
        self._cohorts: list[KVBatch] = []  # scheduler thread only
        self.max_cohorts = max_cohorts
        self.merge_ratio = merge_ratio
        self.prefill_tokens = prefill_tokens
        self._thread: threading.Thread | None = None
        self.released = False  # release_memory ran and resume_memory has not
        self.dtype = dtype
        # LoRA: the adapted modules' base weights (module name -> copy), from the first
        # adapter on; every adapter is merged into these, never into the served weights.
        self._lora_base: dict[str, torch.Tensor] | None = None
        self._stats = {"requests": 0, "tokens": 0, "steps": 0, "prefills": 0, "prefill_tokens": 0, "aborted_requests": 0,
                       "busy_s": 0.0,
                       # rows ended by an error; forwards of several rows that raised and
                       # were retried row by row
                       "failed_requests": 0, "isolated_steps": 0}

    @classmethod
    def from_options(cls, model_path: str, opts: EngineOptions) -> HFEngine:
        # Nothing to prepare for `release_memory`: the KV cache is allocated per cohort.
        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model_path, max_batch_size=opts.max_batch_size, device=device,
                   dtype=opts.dtype, batching=opts.batching, **opts.engine_kwargs)

    # ----------------------------------------------------------------- public API
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        req = self.limits.admit(req)
        if req.max_new_tokens == 0:
            return GenerationResult([], [], [], "length", req.rid)
        loop = asyncio.get_running_loop()
        row = _Row(req, loop, loop.create_future())
        with self._cv:
            self._waiting.append(row)
            self._cv.notify()
        self._ensure_thread()
        res = await row.future
        self._stats["requests"] += 1
        return res

    async def pause(self, mode: str = "abort") -> None:
        check_pause_mode(mode)
        done = concurrent.futures.Future()
        with self._cv:
            self._pause_mode = mode
            self._pause_waiters.append(done)
            self._cv.notify()
        self._ensure_thread()
        await asyncio.wrap_future(done)

    async def resume(self) -> None:
        """Refused while memory is released: only resume_memory reopens then, so the
        caller that released it decides when the GPU is the engine's again."""
        if self.released:
            raise RuntimeError("the engine's memory is released: resume_memory() reopens it")
        self._reopen()

    def _reopen(self) -> None:
        with self._cv:
            self._pause_mode = None
            self._cv.notify()

    async def release_memory(self) -> None:
        """Abort what runs (its KV cache goes with it), keep new requests waiting, and
        give the freed blocks back to CUDA."""
        await self.pause("abort")
        self.released = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def resume_memory(self) -> None:
        """Reopen admission: the KV cache is allocated again as requests come."""
        self.released = False
        self._reopen()

    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        """Pause (aborting or draining running requests), load, serve `version`, resume
        (unless memory is released: then resume_memory reopens)."""
        return await self._swap(lambda: self.load_state_dict(state_dict), version, mode)

    async def update_adapter(self, adapter: Adapter, version: int, mode: str = "abort") -> dict:
        """As `update_weights`, setting each adapted module's weight to base + (B @ A) *
        scaling. The adapter is checked against the base before anything is written, so
        a refused one leaves the served weights as they were."""
        info = await self._swap(lambda: self.apply_adapter(adapter), version, mode)
        return {**info, "adapter_modules": len(adapter.modules)}

    async def _swap(self, load, version: int, mode: str) -> dict:
        t0 = time.perf_counter()
        await self.pause(mode)
        t_paused = time.perf_counter()
        try:
            await asyncio.to_thread(load)
            self.version = version
        finally:
            if not self.released:
                self._reopen()
        return {"pause_s": t_paused - t0, "load_s": time.perf_counter() - t_paused,
                "version": version}

    def apply_adapter(self, adapter: Adapter) -> None:
        """The weights of `adapter`'s modules, merged from the kept base (only while no
        request runs: `update_adapter`)."""
        adapter.check()
        modules = dict(self.model.named_modules())
        if self._lora_base is None:
            missing = [m for m in adapter.modules if not hasattr(modules.get(m), "weight")]
            if missing:
                raise ValueError(f"the adapter adapts {missing[:3]}, which this model does not have")
            base = {m: modules[m].weight.detach().clone() for m in adapter.modules}
            if adapter.meta.base_digest and base_digest(base, self.dtype) != adapter.meta.base_digest:
                raise ValueError(f"the adapter was trained on base {adapter.meta.base} with other "
                                 "weights than this engine serves (base digests differ)")
            self._lora_base = base
        if set(adapter.modules) != set(self._lora_base):
            raise ValueError(f"the adapter adapts {len(adapter.modules)} modules, the previous ones "
                             f"{len(self._lora_base)}: the targets changed within a run")
        with torch.no_grad():
            for m in adapter.modules:
                modules[m].weight.copy_(merge_weight(self._lora_base[m], *adapter.pair(m),
                                                     adapter.meta.scaling))

    def load_state_dict(self, state_dict: dict) -> None:
        self._lora_base = None  # full weights: the base of any later adapter
        # strict=False: a tied lm_head may or may not be present in the sender's dict.
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(self.device) for k, v in state_dict.items()}, strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weight update does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    async def score(self, ids: list[int]) -> list[float]:
        """The probe's logprobs: one unpadded forward beside the scheduler's (read-only:
        the model's head is not patched under the scheduler's forwards), the trainer's
        `token_logprobs` bit for bit, so the same weights give the same bits."""
        from areal_ray.algo.logprobs import shared_model_logprobs

        def forward():
            x = torch.tensor([list(ids)], device=self.device)
            with torch.no_grad():
                return shared_model_logprobs(self.model, x, torch.ones_like(x), 1.0)[0].float().tolist()
        return await asyncio.to_thread(forward)

    async def weights_digest(self) -> dict:
        """The sha256 of the weights this engine computes with (areal_ray.weights.encoding.digest)."""
        return {"digest": digest(self.model.state_dict())}

    def get_version(self) -> int:
        return self.version

    def load(self) -> dict:
        with self._cv:
            waiting = list(self._waiting)
        active = list(self._active)
        return {"queued": len(waiting), "running": len(active), "paused": self._pause_mode,
                "memory_released": self.released,
                "outstanding_tokens": sum(r.remaining() for r in waiting + active),
                **self._stats}

    def generate_batch(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Blocking convenience for scripts and tests (not from inside an event loop)."""
        async def run():
            return await asyncio.gather(*(self.generate(r) for r in reqs))
        return list(asyncio.run(run()))

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # ----------------------------------------------------------------- scheduler
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait()
                    if self._closed:
                        return
                    mode = self._pause_mode
                    new = [] if mode else self._admit()
                if mode == "abort" and self._active:
                    self._stats["aborted_requests"] += len(self._active)
                    self._end_all(reason="abort")
                if mode and not self._active:
                    self._release_pausers()
                    continue
                t0 = time.perf_counter()
                try:
                    if new:
                        self._prefill(new)
                    self._retire()
                    if self._active:
                        self._decode()
                        self._retire()
                except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
                    # Forwards and draws fail row by row (_prefill, _decode): what gets
                    # here broke the cohorts' bookkeeping (a merge that ran out of
                    # memory half way), which no row can be trusted after.
                    for r in [r for r in new if r not in self._active]:
                        r.resolve(error=e)
                    self._end_all(error=e)
                self._stats["busy_s"] += time.perf_counter() - t0

    def _has_work(self) -> bool:
        return (self._closed or bool(self._active) or bool(self._pause_waiters)
                or (bool(self._waiting) and self._pause_mode is None))

    def _admit(self) -> list[_Row]:
        room = self.max_batch_size - len(self._active)
        if self._active and (self.batching == "static" or (
                self.batching == "continuous" and room < self._min_join <= len(self._waiting))):
            # Static: only into an empty batch. Continuous: joins are prefilled and merged
            # together once a few rows are free (each merge copies the running cache).
            # Invariant: a join is its own cohort (no merge), so it joins at once.
            room = 0
        new = []
        while self._waiting and len(new) < room:
            row = self._waiting.popleft()
            if not row.future.cancelled():
                new.append(row)
        return new

    def _release_pausers(self) -> None:
        with self._cv:
            waiters, self._pause_waiters = self._pause_waiters, []
        for w in waiters:
            w.set_result(None)

    def _end_all(self, reason: str | None = None, error: Exception | None = None) -> None:
        rows, self._cohorts = self._active, []
        for row in rows:
            row.resolve(reason, error)

    @property
    def _active(self) -> list[_Row]:
        return [r for c in self._cohorts for r in c.rows if r]

    def _prefill(self, rows: list[_Row]) -> None:
        """Prefill `rows` in length-sorted chunks of at most `prefill_tokens` (padding
        included): a resubmitted 500-token prefix padded next to 20-token prompts would
        cost 25x its work, and after an abort every running row comes back at once."""
        if self.batching == "invariant":  # every request alone: no padding, ever
            for r in rows:
                self._prefill_isolated([r])
            return
        rows = sorted(rows, key=lambda r: len(r.req.input_ids), reverse=True)
        while rows:
            n = max(1, min(len(rows), self.prefill_tokens // len(rows[0].req.input_ids)))
            self._prefill_isolated(rows[:n])
            rows = rows[n:]
        self._consolidate()

    def _prefill_isolated(self, rows: list[_Row]) -> None:
        """Prefill `rows` together; if that raises, each alone, and a row that fails by
        itself ends with its own error."""
        try:
            self._prefill_chunk(rows)
            return
        except Exception as e:  # noqa: BLE001 - isolated below
            if len(rows) == 1:
                self._fail(rows[0], e)
                return
        self._stats["isolated_steps"] += 1
        for r in rows:
            try:
                self._prefill_chunk([r])
            except Exception as e:  # noqa: BLE001 - this row's own failure
                self._fail(r, e)

    def _prefill_chunk(self, rows: list[_Row]) -> None:
        """Prefill `rows` as a new cohort. Changes nothing if it raises: the cohort is
        added, and the rows get their first token, only once the forward and the draw
        have succeeded."""
        width = max(len(r.req.input_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.req.input_ids):] = torch.tensor(r.req.input_ids)
            mask[i, width - len(r.req.input_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = new_cache(self.num_layers)
        out = self.model(input_ids=ids, attention_mask=mask,
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._record(rows, out.logits[:, -1])
        self._cohorts.append(KVBatch(out.past_key_values, mask, rows))
        self._stats["prefills"] += 1
        self._stats["prefill_tokens"] += int(mask.sum())

    def _consolidate(self) -> None:
        """Merge cohorts of similar width (or while there are too many). A cohort costs one
        forward per step; a merge pads the narrower cohort to the wider one's width for
        as long as the wider one's oldest row lives, and every padded column is attended
        to on every step, so rows are only merged with rows of about their length.
        Never in invariant batching, where a row's numerics must not depend on others."""
        while len(self._cohorts) > 1 and self.batching != "invariant":
            ratio, i, j = max((min(a.width, b.width) / max(a.width, b.width, 1), i, j)
                              for i, a in enumerate(self._cohorts)
                              for j, b in enumerate(self._cohorts) if i < j)
            if ratio < self.merge_ratio and len(self._cohorts) <= self.max_cohorts:
                return
            self._cohorts[i].merge(self._cohorts.pop(j))

    def _decode(self) -> None:
        split = False
        for kv in list(self._cohorts):
            try:
                self._step(kv)
            except Exception as e:  # noqa: BLE001 - isolated below
                self._isolate(kv, e)
                split = True
        if split:  # the rows that went on merge again rather than step one forward each
            self._consolidate()
        self._stats["steps"] += 1

    def _step(self, kv: KVBatch) -> None:
        """One decode step of cohort `kv`. If it raises, the cohort is as it was before
        (the forward may have appended to some layers' caches before failing in a later
        one, and the step's mask column is already there)."""
        width = kv.width
        try:
            ids = torch.tensor([[r.out[-1] if r else self.pad_id] for r in kv.rows],
                               device=self.device)
            positions = kv.positions()
            out = self.model(input_ids=ids, attention_mask=kv.step_mask(),
                             position_ids=positions, past_key_values=kv.cache, use_cache=True)
            live = [i for i, r in enumerate(kv.rows) if r]
            self._record([kv.rows[i] for i in live], out.logits[live, -1])
        except BaseException:
            kv.truncate(width)
            raise

    def _isolate(self, kv: KVBatch, error: Exception) -> None:
        """Cohort `kv`'s step raised `error`: step each of its rows as a cohort of its
        own, so only rows that fail by themselves end, each with its own error. A cohort
        of one row ends that row at once."""
        at = self._cohorts.index(kv)
        del self._cohorts[at]  # before any row's caller sees it fail: `load` runs elsewhere
        parts = kv.split()
        if len(parts) == 1:
            self._fail(parts[0].rows[0], error)
            return
        if parts:
            self._stats["isolated_steps"] += 1
        survivors = []
        for part in parts:
            try:
                self._step(part)
                survivors.append(part)
            except Exception as e:  # noqa: BLE001 - this row's own failure
                self._fail(part.rows[0], e)
        self._cohorts[at:at] = survivors

    def _fail(self, row: _Row, error: Exception) -> None:
        self._stats["failed_requests"] += 1
        row.resolve(error=error)

    def _record(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample each row's next token and keep its behaviour logprob and version.

        Unseeded rows draw together from the global generator; a seeded row draws from
        its own generator and its own row of probabilities (exp of a one-row slice), so
        neither the draw nor the RNG state it consumes depends on the other rows."""
        temps = torch.tensor([r.req.temperature if r.req.temperature > 0 else 1.0 for r in rows],
                             device=logits.device)
        greedy = [r.req.temperature <= 0 for r in rows]
        seeded = [i for i, r in enumerate(rows) if r.req.seed is not None and not greedy[i]]
        logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
        tokens = logp.argmax(-1)
        if len(seeded) + sum(greedy) < len(rows):  # some row samples from the global generator
            tokens = torch.where(torch.tensor(greedy, device=logits.device), tokens,
                                 torch.multinomial(logp.exp(), 1).squeeze(-1))
        for i in seeded:
            tokens[i] = torch.multinomial(logp[i].exp(), 1, generator=self._generator(rows[i]))[0]
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        for r, t, lp in zip(rows, tokens.tolist(), chosen.tolist()):
            r.out.append(t)
            r.logprobs.append(lp)
            r.versions.append(self.version)
        self._stats["tokens"] += len(rows)

    def _generator(self, row: _Row) -> torch.Generator:
        if row.generator is None:
            row.generator = torch.Generator(device=self.device)
            row.generator.manual_seed(int(row.req.seed))
        return row.generator

    def _retire(self) -> None:
        """Resolve finished rows at once; compact a cohort only once a quarter of its rows
        are dead (a dead row costs one row of compute per step until then, a compaction
        copies the whole cohort's cache)."""
        shrunk = False
        for kv in self._cohorts:
            for i, r in enumerate(kv.rows):
                if r is None:
                    continue
                reason = r.finished(self.eos_id)
                if reason or r.future.cancelled():
                    kv.rows[i] = None  # before its caller can see it end: `load` runs elsewhere
                if reason:
                    r.resolve(reason)
            live = [i for i, r in enumerate(kv.rows) if r]
            if 4 * (kv.size - len(live)) >= kv.size:
                kv.keep(live)
                shrunk = True
        if shrunk:
            self._cohorts = [kv for kv in self._cohorts if kv.size]
            self._consolidate()
