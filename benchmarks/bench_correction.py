"""Benchmark: what the training/inference mismatch corrections do on a mismatched engine.

    python -m benchmarks.bench_correction --config conf/bench_correction.yaml
    python -m benchmarks.bench_correction --config conf/bench_correction.yaml seeds=[0] \
        arms=[matched,mismatched,token_tis] base.train.steps=10

The quickstart task at eta 4 with the real training job (`run_training`, one arm after
another on one Ray cluster). The mismatch is the one users meet first: the engines run in
`mismatch_dtype` (bfloat16) while the trainer runs and recomputes in float32
(`rollout.dtype`; every push is cast into the engine's dtype), so the behaviour
logprobs the decoupled loss divides by are not the trainer's. Arms:

* `matched`: engine and trainer in float32, no correction (the reference);
* `mismatched`: the bf16 engine, no correction (only the decoupled loss's
  `behav_imp_weight_cap`);
* one arm per `algo.loss.correction.mode` named (token_tis, seq_tis, token_mis,
  seq_mis, geo_mis, icepop) and `cispo` (the CISPO loss, with its defaults): the bf16
  engine with that correction.

Each arm runs once per seed in `seeds` (train.seed and task.seed); arms interleave
within a seed, so machine drift hits them alike. Per arm: greedy held-out accuracy
before and after (mean and per seed), points against `matched`, the measured mismatch
(mean k3 KL and chi-square of the engine's logprobs against the trainer's over the run),
the fraction of tokens masked or truncated by the correction, the mean entropy, wall s.

Writes the JSON report and a markdown table, and prints one summary line.
"""

from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_ray.config import Config, ConfigError, opt, to_dict, validate
from jobs.cli import bench_main, interleaved_runs, write_report

# arm name -> what it changes on the mismatched engine (None: the matched reference)
CORRECTION_ARMS = ("token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mis", "icepop")
ARMS = ("matched", "mismatched", *CORRECTION_ARMS, "cispo")
# per-step means averaged over the run (absent keys: the arm did not record them)
STEP_KEYS = ("mismatch_k3", "mismatch_chi2", "mismatch_ppl_ratio", "entropy",
             "correction_masked_frac", "correction_truncated_frac", "behav_weight_mean")


@dataclass
class BenchCorrectionConfig:
    arms: list = opt(list(ARMS), f"arms to run, in order: {', '.join(ARMS)}; must include matched (the reference)")
    seeds: list = opt([0, 1, 2], "train.seed and task.seed of each repetition")
    mismatch_dtype: str = opt("bfloat16", "the mismatched engines' dtype (rollout.dtype): bfloat16 or float16")
    out: str = opt("runs/bench_correction/report.json", "JSON report; the markdown table and the arms' run dirs go next to it")
    base: Config = field(default_factory=Config, metadata={"help": "the run config every arm shares"})


def check(c: BenchCorrectionConfig) -> BenchCorrectionConfig:
    arms = list(c.arms)
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise ConfigError(f"arms must be distinct names from {ARMS}, got {arms}")
    if "matched" not in arms:
        raise ConfigError("arms must include matched: every accuracy is compared with it")
    seeds = list(c.seeds)
    if not seeds or any(not isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be distinct integers, got {seeds}")
    if c.mismatch_dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"mismatch_dtype must be bfloat16 or float16, got {c.mismatch_dtype!r}")
    if c.base.model.dtype != "float32" or c.base.rollout.dtype not in ("", "float32"):
        raise ConfigError("base.model.dtype must be float32 and base.rollout.dtype unset: the arms "
                          "set the engine's dtype themselves")
    validate(c.base)
    return c


def arm_config(base: Config, arm: str, seed: int, mismatch_dtype: str, run_dir: Path) -> Config:
    cfg = copy.deepcopy(base)
    cfg.train.seed = seed
    cfg.task.seed = seed
    if arm != "matched":
        cfg.rollout.dtype = mismatch_dtype
    if arm in CORRECTION_ARMS:
        cfg.algo.loss.correction.mode = arm
    if arm == "cispo":
        cfg.algo.loss.name = "cispo"
    cfg.run.name = f"{base.run.name}-{arm}-s{seed}"
    cfg.run.run_dir = str(run_dir)
    cfg.run.eval_before = True
    cfg.run.eval_after = True
    return validate(cfg)


def step_means(steps: list[dict]) -> dict:
    out = {}
    for k in STEP_KEYS:
        vals = [s[k] for s in steps if isinstance(s.get(k), (int, float)) and s[k] == s[k]]
        if vals:
            out[k] = statistics.fmean(vals)
    return out


def summarise(runs: list[dict], arms: list[str]) -> list[dict]:
    """One row per arm: its seeds' runs averaged, points against matched."""
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        row = {"arm": arm, "seeds": [r["seed"] for r in mine],
               "accuracy_after": [r["eval_accuracy_after"] for r in mine],
               "accuracy_before": [r["eval_accuracy_before"] for r in mine],
               "wall_s": statistics.fmean(r["wall_s"] for r in mine)}
        row["accuracy_after_mean"] = statistics.fmean(row["accuracy_after"])
        for k in STEP_KEYS:
            vals = [r["steps"][k] for r in mine if k in r["steps"]]
            if vals:
                row[k] = statistics.fmean(vals)
        rows.append(row)
    ref = next(r for r in rows if r["arm"] == "matched")["accuracy_after_mean"]
    for row in rows:
        row["points_vs_matched"] = 100 * (row["accuracy_after_mean"] - ref)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| arm | accuracy after (mean; per seed) | vs matched (points) | k3 mismatch | "
            "chi2 | masked | truncated | entropy |\n|---|---|---|---|---|---|---|---|")

    def f(row, k, fmt="{:.4f}"):
        return fmt.format(row[k]) if k in row else "-"
    lines = [head] + [
        f"| {r['arm']} | {r['accuracy_after_mean']:.3f}; "
        f"{' '.join(f'{a:.3f}' for a in r['accuracy_after'])} | {r['points_vs_matched']:+.1f} | "
        f"{f(r, 'mismatch_k3', '{:.2e}')} | {f(r, 'mismatch_chi2', '{:.2e}')} | "
        f"{f(r, 'correction_masked_frac', '{:.3f}')} | {f(r, 'correction_truncated_frac', '{:.3f}')} | "
        f"{f(r, 'entropy', '{:.3f}')} |" for r in rows]
    return "\n".join(lines)


def summary_line(report: dict) -> str:
    rows = report["rows"]
    parts = [f"bench_correction [{report['machine']}, {report['base']['rollout']['backend']}, "
             f"eta {report['base']['algo']['eta']}, {report['base']['train']['steps']} steps, "
             f"{len(report['seeds'])} seeds, engine {report['mismatch_dtype']} vs trainer float32]"]
    parts.append(" ".join(f"{r['arm']} {r['accuracy_after_mean']:.3f} ({r['points_vs_matched']:+.1f})"
                          for r in rows))
    mis = next((r for r in rows if r["arm"] == "mismatched"), None)
    if mis and "mismatch_k3" in mis:
        parts.append(f"mismatch k3 {mis['mismatch_k3']:.2e}/token")
    return "; ".join(parts)


def run_bench(c: BenchCorrectionConfig, argv: list[str]) -> dict:
    from areal_ray.observe.tracking import lineage, read_events
    from areal_ray.run.job import run_training
    from benchmarks.bench_async import machine

    out = Path(c.out)
    seeds = list(c.seeds)

    def run_one(arm: str, repeat: int, run_dir: Path) -> dict:
        seed = seeds[repeat]
        cfg = arm_config(c.base, arm, seed, c.mismatch_dtype, run_dir)
        summary = run_training(cfg)
        steps = lineage(read_events(run_dir / "steps.jsonl"))
        return {"arm": arm, "seed": seed, "run_dir": str(run_dir),
                "eval_accuracy_before": summary.get("eval_accuracy_before"),
                "eval_accuracy_after": summary.get("eval_accuracy_after"),
                "wall_s": summary.get("wall_s"), "steps": step_means(steps)}

    runs = interleaved_runs(out, "bench_correction", len(seeds), list(c.arms), run_one)
    rows = summarise(runs, list(c.arms))
    report = {"machine": machine(), "command": "python -m benchmarks.bench_correction " + " ".join(argv),
              "mismatch_dtype": c.mismatch_dtype, "seeds": list(c.seeds), "base": to_dict(c.base),
              "rows": rows, "runs": runs, "table_md": str(out.with_suffix(".md"))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table(rows) + "\n")
    return write_report(report, out, summary_line)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_correction", __doc__.splitlines()[0],
                      BenchCorrectionConfig, check, run_bench)


if __name__ == "__main__":
    sys.exit(main())
