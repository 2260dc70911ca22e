"""Benchmark: what a LoRA adapter push does to running requests on vLLM
(`rollout.lora_push`): pause (abort them and resume under the new adapter, as a full
push does) against finish (they end under the adapter they started with).

    python -m benchmarks.bench_lora_push [out=runs/bench_lora_push/report.json]
        [modes=[pause,finish]] [repeats=1] [overrides=[train.steps=20]]

Each arm is the real training job on `config` (the LoRA quickstart) with
`rollout.backend=vllm`, the arms interleaved (pause, finish, pause, finish, ...) so that
machine drift hits both alike. Per arm: wall time, trained samples/s (steady and end to
end), accuracy before and after, staleness (mean and max: finish trains whole samples
of older versions, pause resumes them under newer ones), resubmitted generations, and
the medians over the steps of the push's total seconds and of the replica's load (for
pause that includes the abort of the running requests). Writes the JSON report and
prints one summary line; the mode with the most steady samples/s is `faster`.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_ray.config import ConfigError, LoraPush, load_config, opt
from jobs.cli import bench_main, interleaved_runs, write_report

# figures copied from each arm's summary
ARM_KEYS = ("wall_s", "train_s", "steady_samples_per_s", "samples_per_s",
            "eval_accuracy_before", "eval_accuracy_after", "mean_staleness", "max_staleness",
            "trainer_idle_fraction", "rollout_idle_fraction", "n_samples")


@dataclass
class BenchLoraPushConfig:
    config: str = opt("conf/quickstart_lora.yaml", "the run config every arm shares")
    overrides: list = opt([], "key=value overrides of that config, for every arm")
    modes: list = opt(["pause", "finish"], "rollout.lora_push values to compare")
    repeats: int = opt(1, "runs of each mode")
    out: str = opt("runs/bench_lora_push/report.json", "JSON report; the arms' run dirs go next to it")


def check(c: BenchLoraPushConfig) -> BenchLoraPushConfig:
    if not c.modes or any(m not in LoraPush.values() for m in c.modes):
        raise ConfigError(f"modes must be a non-empty subset of {list(LoraPush.values())}, "
                          f"got {list(c.modes)}")
    if c.repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {c.repeats}")
    arm_config(c, c.modes[0], Path("/nonexistent"))  # the shared config loads and checks
    return c


def arm_config(c: BenchLoraPushConfig, mode: str, run_dir: Path):
    return load_config(c.config, [*c.overrides, "rollout.backend=vllm", "model.lora.enabled=true",
                                  f"rollout.lora_push={mode}", f"run.run_dir={run_dir}",
                                  "run.eval_after=true"])


def arm(mode: str, summary: dict, steps: list[dict], run_dir: str) -> dict:
    """One arm's figures: its summary's, and per-step medians of its push records."""
    def median(key):
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(values) if values else None
    return {"mode": mode, "run_dir": run_dir, **{k: summary.get(k) for k in ARM_KEYS},
            "resubmits": sum(s.get("resubmits", 0) for s in steps),
            "push_total_s_median": median("push_total_s"),
            "push_load_s_median": median("push_load_s")}


def compare(arms: list[dict]) -> dict:
    """Per mode: the mean of each figure over its repeats; `faster`: the mode with the
    most steady samples/s."""
    by_mode: dict[str, dict] = {}
    for mode in dict.fromkeys(a["mode"] for a in arms):
        mine = [a for a in arms if a["mode"] == mode]
        by_mode[mode] = {k: statistics.fmean(a[k] for a in mine)
                         for k in mine[0] if isinstance(mine[0][k], int | float)
                         and all(isinstance(a[k], int | float) for a in mine)}
    faster = max(by_mode, key=lambda m: by_mode[m].get("steady_samples_per_s", 0.0))
    return {"by_mode": by_mode, "faster": faster}


def summary_line(report: dict) -> str:
    parts = []
    for mode, m in report["by_mode"].items():
        parts.append(f"{mode}: {m.get('steady_samples_per_s', float('nan')):.2f} samples/s steady, "
                     f"wall {m.get('wall_s', float('nan')):.0f} s, accuracy "
                     f"{m.get('eval_accuracy_after', float('nan')):.3f}, staleness mean "
                     f"{m.get('mean_staleness', float('nan')):.2f} max "
                     f"{m.get('max_staleness', float('nan')):.0f}, push "
                     f"{m.get('push_total_s_median', float('nan')):.3f} s, "
                     f"{m.get('resubmits', 0):.0f} resubmits")
    return (f"bench_lora_push [{report['repeats']} run(s) per mode]: " + "; ".join(parts)
            + f"; faster: {report['faster']}")


def run_bench(c: BenchLoraPushConfig, argv: list[str]) -> dict:
    from areal_ray.observe.tracking import lineage, read_events
    from areal_ray.run.job import run_training
    from benchmarks.bench_async import machine

    out = Path(c.out)

    def run_one(mode: str, repeat: int, run_dir: Path) -> dict:
        summary = run_training(arm_config(c, mode, run_dir))
        return arm(mode, summary, lineage(read_events(run_dir / "steps.jsonl")), str(run_dir))
    arms = interleaved_runs(out, "bench_lora_push", c.repeats, c.modes, run_one)
    report = {"machine": machine(), "command": "python -m benchmarks.bench_lora_push " + " ".join(argv),
              "config": c.config, "overrides": list(c.overrides), "repeats": c.repeats,
              "arms": arms, **compare(arms)}
    return write_report(report, out, summary_line)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_lora_push", __doc__.splitlines()[0],
                      BenchLoraPushConfig, check, run_bench)


if __name__ == "__main__":
    sys.exit(main())
