"""Benchmark: a job's fixed cost, from its launch to its first trained step.

    python -m benchmarks.bench_start --config conf/bench_start.yaml [repeats=3]

Each run is the training command as a user types it, timed from the moment it is
launched: `python -m jobs.train` on a private local cluster it starts itself
(`local`), and `ray job submit` to a cluster that was started once with `ray start
--head` (`submit`: how Ray users run many jobs; the bench starts that cluster before
the first run and stops it after the last). Each mode runs with the trainer started
beside the replicas (`run.overlap_start=true`) and after them (`false`), interleaved,
so the machine's drift hits every arm alike.

Per run: launch to first step (the step record's wall clock minus the launch time),
`first_step_s` of summary.json (from `run_training`'s call: the job's own start-up,
without the interpreter and the cluster), launch to the job's end; per arm the median.
Writes the JSON report and prints one summary line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from areal_ray.config import Config, ConfigError, opt, to_dict, validate
from benchmarks.bench_async import machine
from jobs.cli import bench_main, distinct_choices, write_report

MODES = ("local", "submit")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class BenchStartConfig:
    modes: list = opt(list(MODES), f"how the job is launched, from {list(MODES)}")
    overlap: list = opt([True, False], "run.overlap_start values to compare")
    repeats: int = opt(2, "runs per arm, interleaved")
    out: str = opt("runs/bench_start/report.json", "JSON report; the run dirs go next to it")
    base: Config = field(default_factory=Config, metadata={"help": "the run config every run shares"})


def check(c: BenchStartConfig) -> BenchStartConfig:
    distinct_choices("modes", c.modes, MODES)
    if not c.overlap or len(set(c.overlap)) != len(c.overlap):
        raise ConfigError(f"overlap must be distinct booleans, got {list(c.overlap)}")
    if c.repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {c.repeats}")
    if c.base.run.ray_address:
        raise ConfigError("base.run.ray_address must be empty: each mode chooses its cluster")
    validate(c.base)
    return c


def first_step_wall(run_dir: Path) -> float | None:
    """The wall clock of the run's first step record (steps.jsonl), None without one."""
    path = run_dir / "steps.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "t_wall" in rec and rec.get("event") is None:
            return rec["t_wall"]
    return None


def command(mode: str, config_file: Path, overlap: bool, run_dir: Path, name: str, head) -> list[str]:
    job = [sys.executable if mode == "local" else "python", "-m", "jobs.train",
           "--config", str(config_file), f"run.overlap_start={str(overlap).lower()}",
           f"run.run_dir={run_dir}", f"run.name={name}"]
    if mode == "local":
        return job
    return [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address",
            head.dashboard_url, "--working-dir", str(REPO), "--", *job]


def one_run(mode: str, overlap: bool, repeat: int, config_file: Path, root: Path, head) -> dict:
    name = f"start-{mode}-{'overlap' if overlap else 'sequential'}-{repeat}"
    run_dir = (root / name).absolute()
    log = root / f"{name}.log"
    env = head.env if mode == "submit" else None
    print(f"[bench_start] {name}", flush=True)
    t0 = time.time()
    done = subprocess.run(command(mode, config_file, overlap, run_dir, name, head), cwd=REPO,
                          env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    t_end = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {done.returncode}); its output: {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    first = first_step_wall(run_dir)
    return {"mode": mode, "overlap": overlap, "repeat": repeat, "run_dir": str(run_dir),
            "launch_to_first_step_s": None if first is None else first - t0,
            "first_step_s": summary.get("first_step_s"), "launch_to_end_s": t_end - t0,
            "wall_s": summary["wall_s"]}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for r in runs:
        out.setdefault(f"{r['mode']}/{'overlap' if r['overlap'] else 'sequential'}", []).append(r)
    keys = ("launch_to_first_step_s", "first_step_s", "launch_to_end_s")
    return {arm: {k: statistics.median(r[k] for r in mine) for k in keys
                  if all(r[k] is not None for r in mine)} | {"runs": len(mine)}
            for arm, mine in out.items()}


def summary_line(report: dict) -> str:
    parts = [f"{arm}: first step {v['launch_to_first_step_s']:.1f} s after launch "
             f"({v['first_step_s']:.1f} s in the job)"
             for arm, v in report["arms"].items() if "launch_to_first_step_s" in v]
    return f"bench_start [{report['machine']}; median of {report['repeats']}] " + "; ".join(parts)


def run_bench(c: BenchStartConfig, argv: list[str]) -> dict:
    from areal_ray.cluster.head import start_head

    out = Path(c.out)
    root = (out.parent / f"{out.stem}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    root.mkdir(parents=True)
    config_file = root / "base.yaml"
    OmegaConf.save(OmegaConf.create(to_dict(c.base)), config_file)
    head = start_head(root / "ray_start.log") if "submit" in c.modes else None
    runs = []
    try:
        for repeat in range(c.repeats):
            for mode in c.modes:
                for overlap in c.overlap:
                    runs.append(one_run(mode, overlap, repeat, config_file, root, head))
    finally:
        if head is not None:
            head.stop()
    report = {"machine": machine(), "command": "python -m benchmarks.bench_start " + " ".join(argv),
              "base": to_dict(c.base), "repeats": c.repeats, "runs": runs, "arms": summarize(runs)}
    return write_report(report, out, summary_line)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_start", __doc__.splitlines()[0],
                      BenchStartConfig, check, run_bench)


if __name__ == "__main__":
    sys.exit(main())
