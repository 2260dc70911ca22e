"""Benchmark: what reproducibility costs the HF engine (`batching` invariant vs continuous).

    python -m benchmarks.bench_repro [out=runs/bench_repro.json] [prompts=32] [group_size=8]
        [max_new_tokens=128] [max_batch_size=64] [repeats=3] [checked=16] [threads=1]

The workload is a rollout's: `prompts` random prompts of 16-64 tokens (the embedded
model, artifacts/tiny), `group_size` seeded samples each (seeds as the client derives
them: rollout/seeds.py when present, else a hash of (prompt, sample)), output budgets
drawn log-normal up to `max_new_tokens`, generated to the full budget (ignore_eos) at
temperature 1, every request submitted at once, one per `generate` call. Both modes
run the same requests, interleaved, `repeats` times; the median run by tokens/s is
reported. `torch_threads` as in a rollout replica (`rollout.torch_threads`, 1).

Bit-identity, from the same runs: `checked` of the requests are generated again
alone, and their tokens and logprobs compared with what they got among the others
(tokens equal, logprobs equal bit for bit, largest logprob difference before the
first differing token). Writes JSON and prints one summary line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_ray.config import opt
from areal_ray.rollout.engines.base import GenerationRequest
from benchmarks.bench_rollout import in_process, make_engine, run
from jobs.cli import job_config


def seed_of(position: int, sample: int) -> int:
    try:
        from areal_ray.rollout.seeds import request_seed
        return request_seed(0, position, sample, 0)
    except ImportError:  # before the client side lands: the same kind of seed
        key = f"0/{position}/{sample}/0".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def group_requests(prompts: int, group_size: int, max_new_tokens: int, vocab: int,
                   seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    reqs = []
    for p in range(prompts):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(16, 64))]
        for s in range(group_size):
            budget = int(min(max_new_tokens, max(4, rng.lognormvariate(3.5, 0.8))))
            reqs.append(GenerationRequest(prompt, budget, 1.0, rid=f"{p}/{s}", ignore_eos=True,
                                          seed=seed_of(p, s)))
    return reqs


def compare(engine, reqs, got: list[dict], idx: list[int]) -> dict:
    """Requests `idx` again, one at a time, vs what they got among the others."""
    ids_equal = bits_equal = 0
    max_diff = 0.0
    for i in idx:
        alone = run(engine.generate(reqs[i]))
        a, b = alone.output_ids, got[i]["output_ids"]
        same = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        d = (torch.tensor(alone.logprobs[:same]) - torch.tensor(got[i]["logprobs"][:same])).abs()
        max_diff = max(max_diff, float(d.max()) if same else 0.0)
        ids_equal += a == b
        bits_equal += a == b and alone.logprobs == got[i]["logprobs"]
    return {"checked": len(idx), "ids_equal": ids_equal, "ids_and_logprobs_bit_equal": bits_equal,
            "max_abs_logprob_diff": max_diff}


def measure(engine, reqs) -> tuple[dict, list[dict]]:
    """in_process's run, keeping the results for the bit-identity check."""
    kept: list[dict] = []
    orig = engine.generate

    async def keep(r):
        res = await orig(r)
        kept.append((r, res))
        return res
    engine.generate = keep
    try:
        out = in_process(engine, reqs)
    finally:
        engine.generate = orig
    by_req = {id(r): res.to_dict() for r, res in kept}  # the warm-up repeats reqs[:8]
    return out, [by_req[id(r)] for r in reqs]


@dataclass
class BenchReproConfig:
    out: str = opt("runs/bench_repro.json", "JSON report path")
    prompts: int = opt(32, "prompts (each a group of seeded samples)")
    group_size: int = opt(8, "samples per prompt")
    max_new_tokens: int = opt(128, "largest generation budget")
    max_batch_size: int = opt(64, "engine batch size")
    repeats: int = opt(3, "interleaved repeats of each mode (the median is reported)")
    checked: int = opt(16, "requests regenerated alone for the bit-identity check")
    threads: int = opt(1, "torch intra-op threads (rollout.torch_threads)")
    model: str = opt("artifacts/tiny", "model directory (the embedded model)")


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m benchmarks.bench_repro", __doc__.splitlines()[0], BenchReproConfig)
    if c is None:
        return 2
    from areal_ray.run.job import resolve_model
    torch.set_num_threads(c.threads)
    model = resolve_model(c.model)
    modes = ["continuous", "invariant"]
    engines = {m: make_engine("hf", model, c.max_batch_size, m) for m in modes}
    vocab = len(engines["continuous"].tokenizer)
    reqs = group_requests(c.prompts, c.group_size, c.max_new_tokens, vocab)
    trials: dict[str, list[dict]] = {m: [] for m in modes}
    outputs: dict[str, list[dict]] = {}
    for _ in range(c.repeats):
        for m in modes:
            res, outputs[m] = measure(engines[m], reqs)
            trials[m].append(res)
    idx = random.Random(1).sample(range(len(reqs)), min(c.checked, len(reqs)))
    identity = {m: compare(engines[m], reqs, outputs[m], idx) for m in modes}
    for e in engines.values():
        e.shutdown()
    med = {m: {**sorted(v, key=lambda r: r["tokens_per_s"])[len(v) // 2],
               "trials_tokens_per_s": [round(r["tokens_per_s"]) for r in v]} for m, v in trials.items()}
    tps = {m: med[m]["tokens_per_s"] for m in modes}
    budgets = sorted(r.max_new_tokens for r in reqs)
    n = len(reqs)
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}, {c.threads} torch thread(s)",
              "model": c.model, "requests": n, "prompts": c.prompts, "group_size": c.group_size,
              "max_batch_size": c.max_batch_size, "repeats": c.repeats,
              "budget_p50_p90_max": [budgets[n // 2], budgets[int(0.9 * n)], budgets[-1]],
              "results": med, "invariant_over_continuous": tps["invariant"] / tps["continuous"],
              "bit_identity_alone_vs_in_traffic": identity}
    out = Path(c.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    ident = "; ".join(f"{m} {v['ids_and_logprobs_bit_equal']}/{v['checked']} bit-identical "
                      f"({v['ids_equal']} same tokens, max logprob diff {v['max_abs_logprob_diff']:.2g})"
                      for m, v in identity.items())
    print(f"bench_repro [{report['machine']}, {c.model}, {n} seeded requests, budgets p50/p90/max "
          f"{report['budget_p50_p90_max']}] tok/s: continuous {tps['continuous']:.0f}, invariant "
          f"{tps['invariant']:.0f} (x{report['invariant_over_continuous']:.2f}); alone vs in traffic: "
          f"{ident} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
