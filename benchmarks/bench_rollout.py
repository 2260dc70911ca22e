"""Benchmark: the rollout service on a long tail of output lengths, per engine backend.

    python -m benchmarks.bench_rollout [out=runs/bench_rollout.json] [requests=512]
        [max_new_tokens=512] [max_batch_size=128] [hidden=128] [layers=4]
        [push_every=64] [serve=true] [repeats=3] [backends=[hf,vllm]]

Every comparison runs the same requests: random prompts of 16-64 tokens and output
budgets drawn log-normal (most short, a few near `max_new_tokens`, like reasoning
traces), generated to the full budget (ignore_eos) on a randomly initialised
Qwen2-architecture model (no download; its size is `hidden`/`layers`), one thread per
engine (torch threads for `hf`, OpenMP threads of the engine-core worker for `vllm`).
Tokens/s counts output tokens delivered to clients; `cpu_s` is the CPU time of this
process and its children during the run (vLLM's front end and engine core are busy
too, so its tokens per CPU-second tell what a core buys).

Per backend (`hf`: our HFEngine; `vllm`: VLLMEngine on vLLM's AsyncLLM):
* in-process: every request submitted at once, one request per `generate` call (the
  shape our protocol feeds an engine); `hf` also runs `static` batching (admits only
  into an empty batch), `vllm` also runs vLLM's own offline `LLM.generate` on the
  whole list (`vllm_offline`: its batch speed, the ceiling for our shape);
* Serve vs in-process: the engine behind one Rollout Serve replica (1 CPU) driven
  through a deployment handle;
* interruptible vs wait-for-finish: clients run the interruptible workflow while
  new weights are loaded each time `push_every` more samples have completed (as the
  trainer pushes after each batch); with interruption a push aborts running requests,
  which resume from their partial output (its KV recomputed), without it a push holds
  new requests back until the running ones finish (`push_pause_s`).

Each variant runs `repeats` times, interleaved, and reports its median run. One vLLM
engine serves all of its in-process variants (it takes ~15 s to start). Writes JSON
and prints one summary line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import opt
from areal_ray.rollout.engines.base import EngineOptions, GenerationRequest
from areal_ray.rollout.engines.registry import build_engine
from areal_ray.rollout.interruptible import generate_interruptible
from areal_ray.task.tiny_model import TinyModelSpec, qwen2_config
from areal_ray.task.tokenizer import save_char_tokenizer
from jobs.cli import job_config

# One loop for the whole bench: vLLM's AsyncLLM binds its output handler to the loop
# of its first request.
LOOP = asyncio.new_event_loop()
KV_CACHE_MB = 512  # vLLM: room for max_batch_size rows of the longest budget


def run(coro):
    return LOOP.run_until_complete(coro)


def long_tail_requests(n: int, max_new_tokens: int, vocab: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(16, 64))]
        budget = int(min(max_new_tokens, max(4, rng.lognormvariate(4.0, 0.9))))
        reqs.append(GenerationRequest(prompt, budget, 1.0, ignore_eos=True))
    return reqs


def make_model_dir(hidden: int, layers: int, max_len: int) -> str:
    out = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    tok = save_char_tokenizer(out)
    spec = TinyModelSpec(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 32), max_position_embeddings=max_len)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen2_config(spec, tok)).save_pretrained(str(out))
    return str(out)


def checked(results: list[dict], reqs: list[GenerationRequest]) -> int:
    """Output tokens delivered; every request must have received its whole budget."""
    got = [len(r["output_ids"]) for r in results]
    want = [r.max_new_tokens for r in reqs]
    if got != want:
        raise RuntimeError(f"incomplete generations: {sum(got)} of {sum(want)} tokens")
    return sum(got)


@contextmanager
def cpu_clock(out: dict):
    """CPU seconds of this process and its children (engine processes) over the block."""
    def total():
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        t = 0.0
        for p in procs:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return t
    t0 = total()
    yield
    out["cpu_s"] = total() - t0


def timed(results_and_wall, reqs, cpu: dict) -> dict:
    res, wall = results_and_wall
    tokens = checked(res, reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, **cpu,
            "tokens_per_cpu_s": tokens / cpu["cpu_s"] if cpu.get("cpu_s") else None}


async def _all_at_once(generate, reqs) -> tuple[list[dict], float]:
    await asyncio.gather(*(generate(r) for r in reqs[:8]))  # warm-up
    t0 = time.perf_counter()
    res = list(await asyncio.gather(*(generate(r) for r in reqs)))
    return res, time.perf_counter() - t0


def make_engine(backend: str, model_dir: str, max_batch_size: int, batching: str = "continuous"):
    kwargs = {"kv_cache_mb": KV_CACHE_MB} if backend == "vllm" else {}
    engine = build_engine(backend, model_dir, EngineOptions(
        max_batch_size=max_batch_size, batching=batching, threads=1, engine_kwargs=kwargs))
    run(engine.warmup())
    return engine


def in_process(engine, reqs) -> dict:
    async def gen(r):
        return (await engine.generate(r)).to_dict()
    cpu: dict = {}
    with cpu_clock(cpu):
        got = run(_all_at_once(gen, reqs))
    return timed(got, reqs, cpu)


def vllm_offline(llm, reqs) -> dict:
    """vLLM's own batch API on the whole request list: its speed with no client shape."""
    from vllm import SamplingParams
    params = [SamplingParams(temperature=1.0, max_tokens=r.max_new_tokens, ignore_eos=True,
                             logprobs=0, detokenize=False) for r in reqs]
    prompts = [{"prompt_token_ids": r.input_ids} for r in reqs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    cpu: dict = {}
    with cpu_clock(cpu):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    return timed(([{"output_ids": o.outputs[0].token_ids} for o in outs], wall), reqs, cpu)


def with_pushes(engine, states: list[dict], reqs, push_every: int, mode: str) -> dict:
    """The interruptible workflow for every request while a new version is loaded each
    time `push_every` more samples have completed (as a trainer would after each batch);
    `mode` is how the engine treats running requests at a push (abort or wait)."""
    async def gen(ids, n, temperature):
        return (await engine.generate(GenerationRequest(ids, n, temperature, ignore_eos=True))).to_dict()

    async def go():
        due: asyncio.Queue = asyncio.Queue()  # one item per batch of completed samples
        pushes = []
        v0 = engine.get_version()

        async def pusher():
            while (await due.get()) is not None:
                v = v0 + len(pushes) + 1
                pushes.append(await engine.update_weights(states[v % 2], v, mode))

        completed = 0

        async def sample(r):
            nonlocal completed
            smp = await generate_interruptible(gen, r.input_ids, r.max_new_tokens, 1.0)
            completed += 1
            if completed % push_every == 0 and completed < len(reqs):
                due.put_nowait(completed)
            return smp

        t0 = time.perf_counter()
        push_task = asyncio.ensure_future(pusher())
        samples = await asyncio.gather(*(sample(r) for r in reqs))
        wall = time.perf_counter() - t0
        due.put_nowait(None)
        await push_task
        return samples, wall, pushes

    prefill0 = engine.load().get("prefill_tokens")
    cpu: dict = {}
    with cpu_clock(cpu):
        samples, wall, pushes = run(go())
    out = timed(([{"output_ids": s.output_ids} for s in samples], wall), reqs, cpu)
    prefill = engine.load().get("prefill_tokens")
    return {**out, "pushes": len(pushes), "push_pause_s": sum(p["pause_s"] for p in pushes),
            "push_load_s": sum(p["load_s"] for p in pushes),
            "resubmits": sum(s.n_resubmits for s in samples),
            "recomputed_prefix_tokens": None if prefill is None
            else prefill - prefill0 - sum(len(r.input_ids) for r in reqs),
            "mixed_version_samples": sum(len(set(s.versions)) > 1 for s in samples)}


class ServeApp:
    """One Rollout Serve replica (1 CPU) of `backend`, driven through a deployment handle."""

    def __init__(self, backend: str, model_dir: str, reqs, max_batch_size: int):
        import ray
        from ray import serve

        from areal_ray.config import load_config
        from deployments.rollout import build_app
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
                     logging_level="WARNING", runtime_env={"env_vars": {
                         "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
        cfg = load_config(None, [f"rollout.backend={backend}", f"rollout.max_batch_size={max_batch_size}",
                                 "rollout.num_cpus=1", f"rollout.max_ongoing_requests={len(reqs) + 8}"]
                          + ([f"rollout.engine_kwargs.kv_cache_mb={KV_CACHE_MB}"] if backend == "vllm" else []))
        serve.start(proxy_location="Disabled")
        self.name = f"bench-rollout-{backend}-{os.getpid()}"
        self.handle = serve.run(build_app(cfg, model_dir), name=self.name, route_prefix=None)

    def measure(self, reqs) -> dict:
        async def gen(r):
            return await self.handle.generate.remote(r)  # the request as the replica takes it
        cpu: dict = {}  # the replica is a Ray worker, not our child: wall time only
        return timed(run(_all_at_once(gen, reqs)), reqs, cpu)

    def delete(self) -> None:
        from areal_ray.cluster.placement import delete_app
        delete_app(self.name)


@dataclass
class BenchRolloutConfig:
    out: str = opt("runs/bench_rollout.json", "JSON report path")
    requests: int = opt(512, "generation requests (log-normal budgets, a long tail)")
    max_new_tokens: int = opt(512, "largest generation budget")
    max_batch_size: int = opt(128, "engine batch size")
    push_every: int = opt(64, "a weight push per this many completed samples (interrupt vs wait)")
    hidden: int = opt(128, "model hidden size")
    layers: int = opt(4, "model layers")
    repeats: int = opt(3, "interleaved repeats of each variant (the median is reported)")
    serve: bool = opt(True, "also measure through a Serve app and handle")
    backends: list = opt(["hf", "vllm"], "engines to compare: hf and/or vllm")


def median_runs(trials: dict[str, list[dict]]) -> dict:
    return {k: {**sorted(v, key=lambda r: r["tokens_per_s"])[len(v) // 2],
                "trials_tokens_per_s": [round(r["tokens_per_s"]) for r in v]}
            for k, v in trials.items() if v}


def ratios_of(tps: dict[str, float]) -> dict[str, float]:
    pairs = {"hf_continuous_over_static": ("hf", "hf_static"),
             "vllm_over_hf": ("vllm", "hf"),
             "vllm_over_vllm_offline": ("vllm", "vllm_offline"),
             "vllm_serve_over_hf_serve": ("vllm_serve", "hf_serve")}
    for b in ("hf", "vllm"):
        pairs[f"{b}_interrupt_over_wait"] = (f"{b}_interrupt", f"{b}_wait")
        pairs[f"{b}_serve_over_in_process"] = (f"{b}_serve", b)
    return {k: tps[a] / tps[b] for k, (a, b) in pairs.items() if a in tps and b in tps}


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m benchmarks.bench_rollout", __doc__.splitlines()[0], BenchRolloutConfig)
    if c is None:
        return 2
    backends = list(c.backends)
    if not backends or set(backends) - {"hf", "vllm"}:
        print(f"error: backends {backends} must be a non-empty subset of [hf, vllm]", file=sys.stderr)
        return 2
    out, n, batch = Path(c.out), c.requests, c.max_batch_size
    torch.set_num_threads(1)
    model_dir = make_model_dir(c.hidden, c.layers, max_len=64 + c.max_new_tokens + 8)
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    n_params = sum(v.numel() for k, v in base.items() if k != "lm_head.weight")
    states = [base, {k: v * 1.01 for k, v in base.items()}]
    reqs = long_tail_requests(n, c.max_new_tokens, vocab=64)
    budgets = sorted(r.max_new_tokens for r in reqs)

    engines = {b: make_engine(b, model_dir, batch) for b in backends}
    runs = {}
    for b, eng in engines.items():
        runs[b] = lambda eng=eng: in_process(eng, reqs)
        runs[f"{b}_interrupt"] = lambda eng=eng: with_pushes(eng, states, reqs, c.push_every, "abort")
        runs[f"{b}_wait"] = lambda eng=eng: with_pushes(eng, states, reqs, c.push_every, "wait")
    if "hf" in engines:
        static = make_engine("hf", model_dir, batch, "static")
        runs["hf_static"] = lambda: in_process(static, reqs)
    if "vllm" in engines:
        from vllm import LLM
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_num_seqs=batch, kv_cache_memory_bytes=KV_CACHE_MB << 20, disable_log_stats=True)
        runs["vllm_offline"] = lambda: vllm_offline(llm, reqs)
    # Interleaved repeats, median by tokens/s: this machine's speed drifts by 10-20 %
    # over minutes, which would otherwise land on whichever variant ran in a slow spell.
    trials: dict[str, list[dict]] = {k: [] for k in runs}
    for _ in range(c.repeats):
        for name, fn in runs.items():
            trials[name].append(fn())
    for eng in engines.values():
        eng.shutdown()
    if "hf" in engines:
        static.shutdown()
        del static
    if "vllm" in engines:
        del llm
    engines.clear()  # vLLM's AsyncLLM.__del__ fails if it first runs at interpreter exit
    if c.serve:  # last, with the in-process engines gone: Ray's processes share the cores
        apps = {b: ServeApp(b, model_dir, reqs, batch) for b in backends}
        for b in backends:
            trials[f"{b}_serve"] = []
        for _ in range(c.repeats):
            for b, app in apps.items():
                trials[f"{b}_serve"].append(app.measure(reqs))
        for app in apps.values():
            app.delete()
    res = median_runs(trials)
    tps = {k: v["tokens_per_s"] for k, v in res.items()}
    ratios = ratios_of(tps)
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread per engine",
              "params": n_params, "requests": n, "max_batch_size": batch, "backends": backends,
              "push_every_samples": c.push_every, "repeats": c.repeats,
              "budget_p50_p90_max": [budgets[n // 2], budgets[int(0.9 * n)], budgets[-1]],
              "results": res, "ratios": ratios}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    parts = [f"{k} {v:.0f}" for k, v in sorted(tps.items())]
    print(f"bench_rollout [{report['machine']}, {n_params / 1e6:.1f}M params, {n} requests, "
          f"budgets p50/p90/max {report['budget_p50_p90_max']}] tok/s: {', '.join(parts)}; "
          f"ratios: {', '.join(f'{k} {v:.2f}' for k, v in ratios.items())} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
