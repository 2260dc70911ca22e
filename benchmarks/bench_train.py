"""Benchmark: trainer tokens/s, packed vs padded, and the cost of the proximal pass.

    python -m benchmarks.bench_train [out=runs/bench_train.json] [groups=16] [group_size=8]
                               [hidden=256] [layers=4] [max_len=512] [repeats=3]

Runs the real `train_step` (train/step.py) in one process on a randomly initialised
Qwen2-architecture model (no download; `hidden`/`layers` set its size) over a batch
with a long tail of output lengths (log-normal, like reasoning traces: most short, a
few near `max_len`), which is where padding wastes most compute. Reports:

* trained tokens/s with padding-free packed micro-batches vs right-padded rows;
* with 4 PPO minibatches per batch, the share of the step spent recomputing pi_prox
  (a no-grad forward over the batch) and the step time with AReaL's log-linear
  approximation instead (no extra forward).

Writes JSON and prints one summary line. Timings are medians over `repeats` runs
after one warm-up run.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from areal_ray.config import load_config, opt
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models, train_step
from jobs.cli import job_config

VOCAB = 512


def long_tail_batch(groups: int, group_size: int, max_len: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for t in range(groups):
        prompt = torch.randint(4, VOCAB, (int(torch.randint(16, 64, (1,), generator=g)),), generator=g)
        for _ in range(group_size):
            n = int(min(max_len - len(prompt), max(4, torch.empty(1).log_normal_(4.0, 0.9, generator=g))))
            seqs.append({"prompt_ids": prompt.tolist(),
                         "output_ids": torch.randint(4, VOCAB, (n,), generator=g).tolist(),
                         "logprobs": [-1.0] * n, "versions": [0] * n,
                         "advantage": float(torch.randn(1, generator=g)), "ticket": t})
    return seqs


def make_model(hidden: int, layers: int, max_len: int):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=max_len,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(cfg)


def time_steps(seqs, overrides: list[str], hidden: int, layers: int, max_len: int,
               repeats: int) -> dict:
    cfg = load_config(None, ["algo.optim.lr=1e-5", *overrides])
    model = make_model(hidden, layers, max_len)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.algo.optim.lr)
    m = Models(model, opt, make_scheduler(opt, repeats + 1, 0, "constant"))
    runs = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        stats = train_step(m, [dict(s) for s in seqs], cfg, pad_id=0, version=0)
        runs.append((time.perf_counter() - t0, stats))
    wall = statistics.median(w for w, _ in runs[1:])
    prox = statistics.median(s["prox_s"] for _, s in runs[1:])
    tokens = sum(len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs)
    return {"overrides": overrides, "step_s": wall, "prox_s": prox, "prox_share": prox / wall,
            "tokens_per_s": tokens / wall, "n_microbatches": runs[-1][1]["n_microbatches"]}


@dataclass
class BenchTrainConfig:
    out: str = opt("runs/bench_train.json", "JSON report path")
    groups: int = opt(16, "prompt groups in the batch")
    group_size: int = opt(8, "samples per group")
    hidden: int = opt(256, "model hidden size")
    layers: int = opt(4, "model layers")
    max_len: int = opt(512, "longest sequence (a long tail of lengths below it)")
    repeats: int = opt(3, "timed steps per variant (the median is reported)")


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m benchmarks.bench_train", __doc__.splitlines()[0], BenchTrainConfig)
    if c is None:
        return 2
    out, groups, group_size, hidden = Path(c.out), c.groups, c.group_size, c.hidden
    layers, max_len, repeats = c.layers, c.max_len, c.repeats
    torch.set_num_threads(os.cpu_count() or 1)
    seqs = long_tail_batch(groups, group_size, max_len)
    lengths = sorted(len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs)
    shape = (hidden, layers, max_len)
    budget = f"algo.microbatch.max_tokens={4 * max_len}"
    res = {
        "packed": time_steps(seqs, ["algo.microbatch.pack=true", budget], *shape, repeats),
        "padded": time_steps(seqs, ["algo.microbatch.pack=false", budget], *shape, repeats),
        "minibatches4_recompute": time_steps(seqs, [
            budget, "algo.optim.ppo_minibatches=4", f"algo.batch_groups={groups}",
            "algo.loss.prox_logp=recompute"], *shape, repeats),
        "minibatches4_loglinear": time_steps(seqs, [
            budget, "algo.optim.ppo_minibatches=4", f"algo.batch_groups={groups}",
            "algo.loss.prox_logp=loglinear"], *shape, repeats),
    }
    n_params = sum(p.numel() for p in make_model(*shape).parameters())
    report = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "params": n_params,
        "sequences": len(seqs), "tokens": sum(lengths),
        "length_p50_p90_max": [lengths[len(lengths) // 2], lengths[int(0.9 * len(lengths))], lengths[-1]],
        "padding_fraction": 1 - sum(lengths) / (len(lengths) * lengths[-1]),
        "results": res,
        "packed_over_padded": res["packed"]["tokens_per_s"] / res["padded"]["tokens_per_s"],
        "loglinear_speedup": res["minibatches4_recompute"]["step_s"] / res["minibatches4_loglinear"]["step_s"],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"bench_train [{report['machine']}, {n_params / 1e6:.1f}M params, {len(seqs)} seqs, "
          f"lengths p50/p90/max {report['length_p50_p90_max']}] packed "
          f"{res['packed']['tokens_per_s']:.0f} tok/s vs padded {res['padded']['tokens_per_s']:.0f} "
          f"({report['packed_over_padded']:.2f}x); 4 minibatches: proximal pass "
          f"{100 * res['minibatches4_recompute']['prox_share']:.0f}% of the step, log-linear "
          f"{report['loglinear_speedup']:.2f}x faster -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
