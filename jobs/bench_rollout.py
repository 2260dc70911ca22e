"""Benchmark: the rollout service on a long tail of output lengths.

    python -m jobs.bench_rollout [out=runs/bench_rollout.json] [requests=512]
        [max_new_tokens=512] [max_batch_size=128] [hidden=128] [layers=4]
        [push_every=64] [serve=true] [repeats=3]

All three comparisons run the same `HFEngine` over the same requests: random prompts
of 16-64 tokens and output budgets drawn log-normal (most short, a few near
`max_new_tokens`, like reasoning traces), generated to the full budget
(ignore_eos) on a randomly initialised Qwen2-architecture model (no download; its
size is `hidden`/`layers`), one torch thread per engine. Tokens/s counts output
tokens delivered to clients.

* continuous vs static batching: every request submitted at once; static batching
  admits only into an empty batch, continuous batching refills each freed row;
* Serve vs in-process: the continuous engine behind one Rollout Serve replica
  (1 CPU) driven through a deployment handle, against the in-process figure;
* interruptible vs wait-for-finish: clients run the interruptible workflow while
  new weights are loaded each time `push_every` more samples have completed (as the
  trainer pushes after each batch; same number of pushes in both modes); with
  interruption a push aborts running requests, which resume from their partial
  output (its KV cache recomputed: `recomputed_prefix_tokens`); without, a push
  holds new requests back until the running ones finish (`push_pause_s`).

Each variant runs `repeats` times, interleaved, and reports its median run. Writes
JSON and prints one summary line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import opt
from areal_ray.rollout.engine import GenerationRequest
from areal_ray.rollout.hf_engine import HFEngine
from areal_ray.rollout.workflow import generate_interruptible
from areal_ray.task.tiny_model import TinyModelSpec, qwen2_config
from areal_ray.task.tokenizer import save_char_tokenizer
from jobs.cli import job_config


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


async def _all_at_once(generate, reqs) -> list[dict]:
    return list(await asyncio.gather(*(generate(r) for r in reqs)))


def in_process(model_dir: str, reqs, max_batch_size: int, batching: str) -> dict:
    engine = HFEngine(model_dir, max_batch_size=max_batch_size, batching=batching)

    async def gen(r):
        return (await engine.generate(r)).to_dict()

    async def run():
        await _all_at_once(gen, reqs[:8])  # warm-up
        t0 = time.perf_counter()
        res = await _all_at_once(gen, reqs)
        return res, time.perf_counter() - t0

    res, wall = asyncio.run(run())
    engine.close()
    tokens = checked(res, reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "decode_steps": engine.load()["steps"]}


def through_serve(model_dir: str, reqs, max_batch_size: int) -> dict:
    import ray
    from ray import serve

    from areal_ray.config import load_config
    from deployments.rollout import build_app
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
                 logging_level="WARNING", runtime_env={"env_vars": {
                     "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    cfg = load_config(None, [f"rollout.max_batch_size={max_batch_size}", "rollout.num_cpus=1",
                             f"rollout.max_ongoing_requests={len(reqs) + 8}"])
    serve.start(proxy_location="Disabled")
    app = f"bench-rollout-{os.getpid()}"
    handle = serve.run(build_app(cfg, model_dir), name=app, route_prefix=None)

    async def gen(r):
        return await handle.generate.remote(r.input_ids, r.max_new_tokens, r.temperature, r.ignore_eos)

    async def run():
        await _all_at_once(gen, reqs[:8])
        t0 = time.perf_counter()
        res = await _all_at_once(gen, reqs)
        return res, time.perf_counter() - t0

    try:
        res, wall = asyncio.run(run())
    finally:
        serve.delete(app)
    tokens = checked(res, reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def with_pushes(model_dir: str, reqs, max_batch_size: int, push_every: int, mode: str) -> dict:
    """The interruptible workflow for every request while a new version is loaded each
    time `push_every` more samples have completed (as a trainer would after each batch);
    `mode` is how the engine treats running requests at a push (abort or wait)."""
    engine = HFEngine(model_dir, max_batch_size=max_batch_size)
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    states = [base, {k: v * 1.01 for k, v in base.items()}]

    async def gen(ids, n, temperature):
        return (await engine.generate(GenerationRequest(ids, n, temperature, ignore_eos=True))).to_dict()

    async def run():
        due: asyncio.Queue = asyncio.Queue()  # one item per batch of completed samples
        pushes = []

        async def pusher():
            while (await due.get()) is not None:
                v = len(pushes) + 1
                pushes.append(await engine.update_weights(states[v % 2], v, mode))

        completed = 0

        async def sample(r):
            nonlocal completed
            s = await generate_interruptible(gen, r.input_ids, r.max_new_tokens, 1.0)
            completed += 1
            if completed % push_every == 0 and completed < len(reqs):
                due.put_nowait(completed)
            return s

        t0 = time.perf_counter()
        push_task = asyncio.ensure_future(pusher())
        samples = await asyncio.gather(*(sample(r) for r in reqs))
        wall = time.perf_counter() - t0
        due.put_nowait(None)
        await push_task
        return samples, wall, pushes

    samples, wall, pushes = asyncio.run(run())
    engine.close()
    tokens = checked([{"output_ids": s.output_ids} for s in samples], reqs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "pushes": len(pushes),
            "push_pause_s": sum(p["pause_s"] for p in pushes),
            "resubmits": sum(s.n_resubmits for s in samples),
            "recomputed_prefix_tokens": engine.load()["prefill_tokens"] - sum(
                len(r.input_ids) for r in reqs),
            "mixed_version_samples": sum(len(set(s.versions)) > 1 for s in samples)}


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


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m jobs.bench_rollout", __doc__.splitlines()[0], BenchRolloutConfig)
    if c is None:
        return 2
    out, n, max_new, batch = Path(c.out), c.requests, c.max_new_tokens, c.max_batch_size
    push_every, hidden, layers, repeats = c.push_every, c.hidden, c.layers, c.repeats
    torch.set_num_threads(1)
    model_dir = make_model_dir(hidden, layers, max_len=64 + max_new + 8)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    reqs = long_tail_requests(n, max_new, vocab=64)
    budgets = sorted(r.max_new_tokens for r in reqs)
    runs = {
        "continuous": lambda: in_process(model_dir, reqs, batch, "continuous"),
        "static": lambda: in_process(model_dir, reqs, batch, "static"),
        "interrupt": lambda: with_pushes(model_dir, reqs, batch, push_every, "abort"),
        "wait": lambda: with_pushes(model_dir, reqs, batch, push_every, "wait"),
    }
    if c.serve:  # last: Ray's own processes then share the cores
        runs["serve"] = lambda: through_serve(model_dir, reqs, batch)
    # Interleaved repeats, median by tokens/s: this machine's speed drifts by 10-20 %
    # over minutes, which would otherwise land on whichever variant ran in a slow spell.
    trials = {k: [] for k in runs}
    order = [n for n in runs if n != "serve"] * repeats + ["serve"] * repeats * ("serve" in runs)
    for name in order:
        trials[name].append(runs[name]())
    res = {k: {**sorted(v, key=lambda r: r["tokens_per_s"])[len(v) // 2],
               "trials_tokens_per_s": [round(r["tokens_per_s"]) for r in v]}
           for k, v in trials.items()}
    tps = {k: v["tokens_per_s"] for k, v in res.items()}
    ratios = {"continuous_over_static": tps["continuous"] / tps["static"],
              "interrupt_over_wait": tps["interrupt"] / tps["wait"]}
    if "serve" in res:
        ratios["serve_over_in_process"] = tps["serve"] / tps["continuous"]
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread per engine",
              "params": n_params, "requests": n, "max_batch_size": batch,
              "push_every_samples": push_every, "repeats": repeats,
              "budget_p50_p90_max": [budgets[n // 2], budgets[int(0.9 * n)], budgets[-1]],
              "results": res, "ratios": ratios}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    serve_part = (f"Serve {tps['serve']:.0f} vs in-process {tps['continuous']:.0f} tok/s "
                  f"({ratios['serve_over_in_process']:.2f}); " if "serve" in res else "")
    print(f"bench_rollout [{report['machine']}, {n_params / 1e6:.1f}M params, {n} requests, "
          f"budgets p50/p90/max {report['budget_p50_p90_max']}] {serve_part}continuous "
          f"{tps['continuous']:.0f} vs static {tps['static']:.0f} tok/s "
          f"({ratios['continuous_over_static']:.2f}x); a push per {push_every} samples: interruptible "
          f"{tps['interrupt']:.0f} vs wait-for-finish {tps['wait']:.0f} tok/s "
          f"({ratios['interrupt_over_wait']:.2f}x) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
