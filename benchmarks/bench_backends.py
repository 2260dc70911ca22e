"""Benchmark: the quickstart end to end with each rollout engine backend.

    python -m benchmarks.bench_backends --config conf/bench_backends.yaml [repeats=2]

Runs the real training job (`run_training`) once per backend per repeat, interleaved
(hf, vllm, hf, vllm, ...) on one Ray cluster, so the machine's drift hits both alike,
with everything else equal: model, task, prompts, steps, eta, resources. Per run it
records wall time, training time, trained samples/s (end to end and steady state),
generation tokens/s, rollout and trainer idle shares, the greedy held-out accuracy
before and after, and the staleness reached; per backend the median run. This is
what decides `rollout.backend` in conf/quickstart.yaml.

Writes the JSON report, a markdown table next to it, and prints one summary line.
"""

from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_ray.config import Config, ConfigError, RolloutBackend, opt, to_dict, validate
from benchmarks.bench_async import machine
from jobs.cli import bench_main, distinct_choices, interleaved_runs, write_report

BACKENDS = RolloutBackend.values()

RUN_KEYS = ("wall_s", "train_s", "samples_per_s", "steady_samples_per_s",
            "generation_tokens_per_s", "rollout_idle_fraction", "trainer_idle_fraction",
            "eval_accuracy_before", "eval_accuracy_after", "max_staleness", "n_samples")
MEDIAN_KEYS = ("wall_s", "train_s", "samples_per_s", "steady_samples_per_s",
               "generation_tokens_per_s", "eval_accuracy_after")


@dataclass
class BenchBackendsConfig:
    backends: list = opt(["hf", "vllm"], f"rollout engines to compare, from {BACKENDS}")
    repeats: int = opt(2, "runs per backend, interleaved")
    out: str = opt("runs/bench_backends/report.json", "JSON report; the markdown table and run dirs go next to it")
    base: Config = field(default_factory=Config, metadata={"help": "the run config every run shares"})


def check(c: BenchBackendsConfig) -> BenchBackendsConfig:
    distinct_choices("backends", c.backends, BACKENDS)
    if c.repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {c.repeats}")
    validate(c.base)
    return c


def run_config(base: Config, backend: str, repeat: int, run_dir: Path) -> Config:
    cfg = copy.deepcopy(base)
    cfg.rollout.backend = backend
    cfg.run.name = f"{base.run.name}-{backend}-{repeat}"
    cfg.run.run_dir = str(run_dir)
    return validate(cfg)


def summarize(runs: list[dict], backends: list[str]) -> dict:
    """Per backend: the median of each figure over its runs, and every run's value."""
    out = {}
    for b in backends:
        mine = [r for r in runs if r["backend"] == b]
        out[b] = {k: statistics.median(r[k] for r in mine) for k in MEDIAN_KEYS
                  if all(r.get(k) is not None for r in mine)}
        out[b]["runs"] = len(mine)
        out[b]["max_staleness"] = max(r["max_staleness"] for r in mine)
    return out


def table(report: dict) -> str:
    head = ("| backend | wall s | train s | trained samples/s (steady) | generation tok/s | "
            "accuracy before -> after | max staleness |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["runs"]:
        rows.append(f"| {r['backend']} | {r['wall_s']:.0f} | {r['train_s']:.0f} | "
                    f"{r['samples_per_s']:.1f} ({r['steady_samples_per_s']:.1f}) | "
                    f"{r['generation_tokens_per_s'] or float('nan'):.0f} | "
                    f"{r['eval_accuracy_before']:.3f} -> {r['eval_accuracy_after']:.3f} | "
                    f"{r['max_staleness']} |")
    return "\n".join(rows)


def summary_line(report: dict) -> str:
    s = report["backends"]
    parts = [f"{b}: wall {v['wall_s']:.0f} s, {v['samples_per_s']:.1f} samples/s "
             f"({v['steady_samples_per_s']:.1f} steady), accuracy {v['eval_accuracy_after']:.3f}"
             for b, v in s.items()]
    line = f"bench_backends [{report['machine']}; median of {report['repeats']}] " + "; ".join(parts)
    if "hf" in s and "vllm" in s:
        line += (f"; vllm/hf samples/s {s['vllm']['samples_per_s'] / s['hf']['samples_per_s']:.2f}x, "
                 f"wall {s['hf']['wall_s'] / s['vllm']['wall_s']:.2f}x")
    return line


def run_bench(c: BenchBackendsConfig, argv: list[str]) -> dict:
    from areal_ray.run.job import run_training

    out = Path(c.out)

    def run_one(backend: str, repeat: int, run_dir: Path) -> dict:
        cfg = run_config(c.base, backend, repeat, run_dir)
        summary = run_training(cfg)
        return {"backend": backend, "repeat": repeat, "run_dir": cfg.run.run_dir,
                **{k: summary.get(k) for k in RUN_KEYS}}
    runs = interleaved_runs(out, "bench_backends", c.repeats, c.backends, run_one)
    report = {"machine": machine(), "command": "python -m benchmarks.bench_backends " + " ".join(argv),
              "base": to_dict(c.base), "repeats": c.repeats, "runs": runs,
              "backends": summarize(runs, list(c.backends))}
    out.with_suffix(".md").write_text(table(report) + "\n")
    report["table_md"] = str(out.with_suffix(".md"))
    return write_report(report, out, summary_line)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_backends", __doc__.splitlines()[0], BenchBackendsConfig, check,
                      run_bench)


if __name__ == "__main__":
    sys.exit(main())
