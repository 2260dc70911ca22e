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
without the interpreter and the cluster), launch to the job's end, and the CPU-seconds
the whole machine spent from launch to the first step, with the processes that spent
them (Ray's workers are separate processes, not the command's children, so the machine
is measured: run nothing else beside it). Those CPU-seconds over the machine's cores
are the floor of the launch time on it: no ordering of the start-up gets below it.
Per arm the median. Writes the JSON report and prints one summary line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from omegaconf import OmegaConf

from areal_ray.config import Config, ConfigError, opt, to_dict, validate
from benchmarks.bench_async import machine
from benchmarks.bench_soak import role
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


class LaunchCpu:
    """CPU-seconds of the whole machine from construction (the launch) to `stop()`,
    and of each process role (bench_soak.role): processes alive at the launch count
    only what they spend after it; a process that ends between two `sample()`s loses
    up to one period of its time (the machine total keeps it)."""

    def __init__(self):
        self.t0 = psutil.cpu_times()
        self.base = self._read()
        self.last = dict(self.base)

    @staticmethod
    def _read() -> dict[tuple[int, float], tuple[str, float]]:
        out = {}
        for p in psutil.process_iter(["cpu_times", "create_time"]):
            try:
                t = p.info["cpu_times"]
                out[(p.pid, p.info["create_time"])] = (role(p), t.user + t.system)
            except (psutil.Error, TypeError, AttributeError):
                pass
        return out

    def sample(self) -> None:
        self.last.update(self._read())

    def stop(self) -> dict:
        self.sample()
        t1 = psutil.cpu_times()
        busy = sum(getattr(t1, k) - getattr(self.t0, k) for k in ("user", "nice", "system")
                   if hasattr(t1, k))
        roles: dict[str, float] = {}
        for key, (name, cpu) in self.last.items():
            spent = cpu - self.base.get(key, (name, 0.0))[1]
            if spent > 0.05:
                roles[name] = roles.get(name, 0.0) + spent
        top = dict(sorted(roles.items(), key=lambda kv: -kv[1]))
        return {"cpu_s": busy, "cores": os.cpu_count(), "cpu_s_by_process": top}


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
    meter, cpu = LaunchCpu(), None
    with log.open("w") as f:
        proc = subprocess.Popen(command(mode, config_file, overlap, run_dir, name, head), cwd=REPO,
                                env=env, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if cpu is None:
                if first_step_wall(run_dir) is not None:
                    cpu = meter.stop()
                else:
                    meter.sample()
            time.sleep(0.5)  # the meter's own CPU (reading every process) is reported too
    t_end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); its output: {log}")
    summary = json.loads((run_dir / "summary.json").read_text())
    first = first_step_wall(run_dir)
    cpu = cpu or {}
    return {"mode": mode, "overlap": overlap, "repeat": repeat, "run_dir": str(run_dir),
            "launch_to_first_step_s": None if first is None else first - t0,
            "first_step_s": summary.get("first_step_s"), "launch_to_end_s": t_end - t0,
            "wall_s": summary["wall_s"], "cpu_s_to_first_step": cpu.get("cpu_s"),
            "floor_s": cpu["cpu_s"] / cpu["cores"] if cpu else None,
            "cpu_s_by_process": cpu.get("cpu_s_by_process")}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for r in runs:
        out.setdefault(f"{r['mode']}/{'overlap' if r['overlap'] else 'sequential'}", []).append(r)
    keys = ("launch_to_first_step_s", "first_step_s", "launch_to_end_s", "cpu_s_to_first_step",
            "floor_s")
    return {arm: {k: statistics.median(r[k] for r in mine) for k in keys
                  if all(r.get(k) is not None for r in mine)} | {"runs": len(mine)}
            for arm, mine in out.items()}


def summary_line(report: dict) -> str:
    parts = [f"{arm}: first step {v['launch_to_first_step_s']:.1f} s after launch "
             f"({v['first_step_s']:.1f} s in the job"
             + (f"; {v['cpu_s_to_first_step']:.0f} CPU-s, floor {v['floor_s']:.1f} s" if "floor_s" in v
                else "") + ")"
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
