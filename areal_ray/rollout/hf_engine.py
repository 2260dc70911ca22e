"""HFEngine: an interruptible, batching inference engine on transformers.

Requests queue up; a background task takes everything waiting (same temperature) and
runs one batched `model.generate` in a worker thread, so the asyncio loop stays free
to accept requests and weight updates. A weight update sets an abort flag that a
`StoppingCriteria` checks after every token: the running batch stops at once, each
request returns its partial output with stop reason "abort", the new weights are
loaded under the generation lock, and the version is bumped. Because a batch never
spans a weight update, every token of a result carries the version that produced it.

Behaviour logprobs are taken from the raw logits that `generate` returns, divided by
the sampling temperature; top-k/top-p are off so that these are exactly the logprobs
of the distribution sampled from (a teacher-forced pass reproduces them).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from areal_ray.rollout.engine import GenerationRequest, GenerationResult


class _BudgetOrAbort(StoppingCriteria):
    """Per-row stop when a row used its own token budget; all rows stop on abort."""

    def __init__(self, prompt_width: int, budgets: torch.Tensor, abort: threading.Event):
        self.prompt_width = prompt_width
        self.budgets = budgets
        self.abort = abort

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.abort.is_set():
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids.shape[1] - self.prompt_width
        return (generated >= self.budgets).to(input_ids.device)


class HFEngine:
    def __init__(self, model_path: str, max_batch_size: int = 64, device: str = "cpu",
                 dtype: str = "float32", version: int = 0):
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.max_batch_size = max_batch_size
        self.version = version
        self._abort = threading.Event()
        self._pending: deque[tuple[GenerationRequest, asyncio.Future]] = deque()
        self._wakeup: asyncio.Event | None = None
        self._gen_lock: asyncio.Lock | None = None
        self._runner: asyncio.Task | None = None
        self._running = 0
        self._stats = {"tokens": 0, "batches": 0, "aborted_requests": 0, "busy_s": 0.0}

    # ----------------------------------------------------------------- public API
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        self._ensure_runner()
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((req, fut))
        self._wakeup.set()
        return await fut

    async def update_weights(self, state_dict: dict, version: int) -> dict:
        """Abort in-flight generation, load `state_dict`, serve `version` from now on."""
        self._ensure_runner()
        t0 = time.perf_counter()
        self._abort.set()
        async with self._gen_lock:
            t_paused = time.perf_counter()
            self.load_state_dict(state_dict)
            self.version = version
            self._abort.clear()
        self._wakeup.set()
        return {"pause_s": t_paused - t0, "load_s": time.perf_counter() - t_paused,
                "version": version}

    def load_state_dict(self, state_dict: dict) -> None:
        # strict=False: a tied lm_head may or may not be present in the sender's dict.
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(self.device) for k, v in state_dict.items()}, strict=False)
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weight update does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    def get_version(self) -> int:
        return self.version

    def load(self) -> dict:
        return {"queued": len(self._pending), "running": self._running, **self._stats}

    # ----------------------------------------------------------------- internals
    def _ensure_runner(self) -> None:
        if self._runner is None:
            self._wakeup = asyncio.Event()
            self._gen_lock = asyncio.Lock()
            self._runner = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                async with self._gen_lock:
                    batch = self._take_batch()
                    if not batch:
                        break
                    self._running = len(batch)
                    t0 = time.perf_counter()
                    try:
                        results = await asyncio.to_thread(
                            self.generate_batch, [r for r, _ in batch], self.version)
                    except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                        for _, fut in batch:
                            if not fut.done():
                                fut.set_exception(e)
                        continue
                    finally:
                        self._running = 0
                        self._stats["busy_s"] += time.perf_counter() - t0
                for (_, fut), res in zip(batch, results):
                    if not fut.done():
                        fut.set_result(res)

    def _take_batch(self) -> list[tuple[GenerationRequest, asyncio.Future]]:
        if not self._pending:
            return []
        key = (self._pending[0][0].temperature, self._pending[0][0].ignore_eos)
        batch, rest = [], deque()
        while self._pending:
            item = self._pending.popleft()
            if (item[0].temperature, item[0].ignore_eos) == key and len(batch) < self.max_batch_size:
                batch.append(item)
            else:
                rest.append(item)
        self._pending = rest
        return batch

    @torch.no_grad()
    def generate_batch(self, reqs: list[GenerationRequest], version: int) -> list[GenerationResult]:
        """One batched generate over requests with the same temperature and ignore_eos (blocking)."""
        temperature, ignore_eos = reqs[0].temperature, reqs[0].ignore_eos
        eos_id = None if ignore_eos else self.eos_id
        # An empty list (not None): None would be filled in from the model's generation config.
        stop_ids = [] if ignore_eos else [self.eos_id]
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding: generation appends on the right
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            att[i, width - len(r.input_ids):] = 1
        budgets = torch.tensor([max(0, r.max_new_tokens) for r in reqs])
        if int(budgets.max()) == 0:
            return [GenerationResult([], [], [], "length", r.rid) for r in reqs]
        greedy = temperature <= 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else temperature, top_k=0, top_p=1.0,
            max_new_tokens=int(budgets.max()), eos_token_id=stop_ids, pad_token_id=self.pad_id,
            return_dict_in_generate=True, output_logits=True)
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=att.to(self.device),
            generation_config=gen_cfg,
            stopping_criteria=StoppingCriteriaList([_BudgetOrAbort(width, budgets, self._abort)]))
        new = out.sequences[:, width:].cpu()
        steps = len(out.logits)
        if steps:
            scale = 1.0 if greedy else temperature
            logits = torch.stack(out.logits, dim=1).float().cpu() / scale  # [B, steps, V]
            lp = torch.log_softmax(logits, dim=-1).gather(-1, new[:, :steps, None]).squeeze(-1)
        aborted = self._abort.is_set()
        results = []
        for i, r in enumerate(reqs):
            toks, lps, reason = [], [], None
            for j in range(steps):
                if j >= budgets[i]:
                    reason = "length"
                    break
                t = int(new[i, j])
                toks.append(t)
                lps.append(float(lp[i, j]))
                if t == eos_id:
                    reason = "stop"
                    break
            if reason is None:
                reason = "length" if len(toks) >= budgets[i] else ("abort" if aborted else "length")
            if reason == "abort":
                self._stats["aborted_requests"] += 1
            self._stats["tokens"] += len(toks)
            results.append(GenerationResult(toks, lps, [version] * len(toks), reason, r.rid))
        self._stats["batches"] += 1
        return results
