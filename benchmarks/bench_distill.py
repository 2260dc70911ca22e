"""Benchmark: on-policy distillation against RL from the task reward alone, same budget.

    python -m benchmarks.bench_distill --config conf/bench_distill.yaml
    python -m benchmarks.bench_distill --config conf/bench_distill.yaml seeds=[0] \
        base.train.steps=8 base.task.n_eval=128

The student is the quickstart's warm start (artifacts/tiny); arms, one after another
on one Ray cluster, interleaved within each seed:

* `distill`: the base config (conf/distill.yaml's settings): the teacher app
  (artifacts/tiny-teacher, the quickstart's model after 20 steps of RL, built on first
  use) scores every sampled token, advantage = teacher - student logprob
  (`algo.distill.reward_weight` mixes in the task's);
* `rl`: the same run with `algo.distill.enabled=false`: GRPO on the task reward.

Same steps, batch, group size, learning rate and seed. Per arm: greedy held-out
accuracy before and after, points gained per step (100 * (after - before) / steps),
the mean training reward, the teacher's numbers (groups scored and late, the mean
per-token reverse KL to the teacher over the run, first and last step) and wall s.
Writes the JSON report and prints one summary line.
"""

from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_ray.config import Config, ConfigError, opt, to_dict, validate
from jobs.cli import bench_main, distinct_choices, interleaved_runs, write_report

ARMS = ("distill", "rl")


@dataclass
class BenchDistillConfig:
    arms: list = opt(list(ARMS), f"arms to run, in order: {', '.join(ARMS)}")
    seeds: list = opt([0], "train.seed and task.seed of each repetition")
    out: str = opt("runs/bench_distill/report.json", "JSON report; the arms' run dirs go next to it")
    base: Config = field(default_factory=Config, metadata={"help": "the run config every arm shares (algo.distill enabled: the distill arm)"})


def check(c: BenchDistillConfig) -> BenchDistillConfig:
    distinct_choices("arms", c.arms, ARMS)
    seeds = list(c.seeds)
    if not seeds or any(not isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be distinct integers, got {seeds}")
    if not c.base.algo.distill.enabled:
        raise ConfigError("base.algo.distill.enabled must be true: the base is the distill arm "
                          "(the rl arm turns it off)")
    validate(c.base)
    return c


def arm_config(base: Config, arm: str, seed: int, run_dir: Path) -> Config:
    cfg = copy.deepcopy(base)
    cfg.train.seed = cfg.task.seed = seed
    cfg.algo.distill.enabled = arm == "distill"
    cfg.run.name = f"{base.run.name}-{arm}-s{seed}"
    cfg.run.run_dir = str(run_dir)
    cfg.run.eval_before = cfg.run.eval_after = True
    return validate(cfg)


def mean_of(steps: list[dict], key: str) -> float | None:
    vals = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
    return statistics.fmean(vals) if vals else None


def run_result(arm: str, seed: int, run_dir: Path, summary: dict, steps: list[dict]) -> dict:
    before, after = summary.get("eval_accuracy_before"), summary.get("eval_accuracy_after")
    n = len(steps)
    return {"arm": arm, "seed": seed, "run_dir": str(run_dir), "steps_run": n,
            "eval_accuracy_before": before, "eval_accuracy_after": after,
            "points_per_step": 100 * (after - before) / n if n and None not in (before, after) else None,
            "reward_mean": mean_of(steps, "reward_mean"),
            "reward_last": steps[-1].get("reward_mean") if steps else None,
            "teacher_scored": sum(s.get("teacher_scored", 0) for s in steps),
            "teacher_late": sum(s.get("teacher_late", 0) + s.get("teacher_dropped", 0) for s in steps),
            "reverse_kl_first": steps[0].get("distill_reverse_kl") if steps else None,
            "reverse_kl_last": steps[-1].get("distill_reverse_kl") if steps else None,
            "reverse_kl_mean": mean_of(steps, "distill_reverse_kl"),
            "wall_s": summary.get("wall_s")}


def summarise(runs: list[dict], arms: list[str]) -> list[dict]:
    rows = []
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]

        def mean(k, mine=mine):
            vals = [r[k] for r in mine if r[k] is not None]
            return statistics.fmean(vals) if vals else None
        rows.append({"arm": arm, "seeds": [r["seed"] for r in mine],
                     **{k: mean(k) for k in ("eval_accuracy_before", "eval_accuracy_after",
                                             "points_per_step", "reward_mean", "reverse_kl_first",
                                             "reverse_kl_last", "wall_s")},
                     "teacher_late": sum(r["teacher_late"] for r in mine)})
    return rows


def summary_line(report: dict) -> str:
    b = report["base"]
    head = (f"bench_distill [{report['machine']}, {b['rollout']['backend']}, eta {b['algo']['eta']}, "
            f"{b['train']['steps']} steps, {len(report['seeds'])} seed(s), reward_weight "
            f"{b['algo']['distill']['reward_weight']}]")

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)
    arms = " ".join(
        f"{r['arm']} {f(r['eval_accuracy_before'], '{:.3f}')}->{f(r['eval_accuracy_after'], '{:.3f}')} "
        f"({f(r['points_per_step'], '{:+.2f}')} pts/step)" for r in report["rows"])
    d = next((r for r in report["rows"] if r["arm"] == "distill"), None)
    kl = (f"; reverse KL to the teacher {f(d['reverse_kl_first'], '{:.3f}')} -> "
          f"{f(d['reverse_kl_last'], '{:.3f}')}/token, {d['teacher_late']} late groups") if d else ""
    return f"{head} {arms}{kl}"


def run_bench(c: BenchDistillConfig, argv: list[str]) -> dict:
    from areal_ray.observe.tracking import lineage, read_events
    from areal_ray.run.job import run_training
    from benchmarks.bench_async import machine

    out = Path(c.out)
    seeds = list(c.seeds)

    def run_one(arm: str, repeat: int, run_dir: Path) -> dict:
        summary = run_training(arm_config(c.base, arm, seeds[repeat], run_dir))
        return run_result(arm, seeds[repeat], run_dir, summary,
                          lineage(read_events(run_dir / "steps.jsonl")))

    runs = interleaved_runs(out, "bench_distill", len(seeds), list(c.arms), run_one)
    report = {"machine": machine(), "command": "python -m benchmarks.bench_distill " + " ".join(argv),
              "seeds": seeds, "base": to_dict(c.base), "rows": summarise(runs, list(c.arms)),
              "runs": runs}
    return write_report(report, out, summary_line)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_distill", __doc__.splitlines()[0],
                      BenchDistillConfig, check, run_bench)


if __name__ == "__main__":
    sys.exit(main())
