"""Soak: a long quickstart run, and whether any process's memory grows with the steps.

    python -m benchmarks.bench_soak [out=runs/bench_soak.json] [steps=500] [period_s=5]
                              [warmup_steps=100] [tail_steps=10] [limit_mib=10]
                              [config=conf/quickstart.yaml]

Runs the real job (`python -m jobs.train`, no eval) for `steps` steps and samples,
every `period_s`, the PSS of each process of its tree (the job, Ray's daemons, every
actor: driver, rollout replica, trainer, Ray Data's coordinator and stages) with the
step reached then (lines of steps.jsonl). For each process role it fits memory
against step by least squares from `warmup_steps` on (start-up allocations and
caches are not growth) to `tail_steps` before the end (the pipeline drains and its
actors exit before the last step record: tear-down is not growth), and reports the
slope in MiB per 100 steps, and the same for the whole tree. The tree passes when its
slope is at most `limit_mib` (issue 30's bound). Writes JSON and prints one line: the
tree's slope, pass or fail, and the roles that grew most.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from areal_ray.config import ConfigError, opt
from jobs.cli import bench_main

REPO = Path(__file__).resolve().parent.parent


@dataclass
class BenchSoakConfig:
    out: str = opt("runs/bench_soak.json", "JSON report path")
    steps: int = opt(500, "training steps of the soak run")
    period_s: float = opt(5.0, "seconds between memory samples")
    warmup_steps: int = opt(100, "steps left out of the fit (start-up, caches filling)")
    tail_steps: int = opt(10, "last steps left out of the fit (the pipeline drains, actors exit)")
    limit_mib: float = opt(10.0, "the whole tree passes at most this many MiB per 100 steps")
    config: str = opt("conf/quickstart.yaml", "the run's config")
    overrides: list = opt([], "more key=value overrides for the run, e.g. [algo.eta=4]")


def role(p: psutil.Process) -> str:
    """A process's role: its Ray title up to the method (`ray::Driver`,
    `ray::ServeReplica:app:Rollout`, `ray::SplitCoordinator`; a Ray Data stage's actor by
    its stage, `ray::MapWorker:RewardStage`) or its program name."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return "?"
    head = cmd[0] if cmd else p.name()
    if head.startswith("ray::"):
        title = head.split()[0]
        if title.startswith("ray::MapWorker("):  # which stage: the innermost name
            return "ray::MapWorker:" + re.sub(r"^.*\(|\).*$", "", title.split(".")[0])
        return re.sub(r"[.(].*$", "", title)
    if "jobs.train" in cmd:
        return "job"
    return Path(head).name or p.name()


def sample(root: psutil.Process) -> dict[str, int]:
    """PSS by role over the process tree of `root`."""
    out: dict[str, int] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            pss = p.memory_full_info().pss
        except psutil.Error:
            continue
        r = role(p)
        out[r] = out.get(r, 0) + pss
    return out


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def growth(samples: list[dict], warmup: int, last: int | None = None) -> dict:
    """MiB per 100 steps by role (and `total`), fitted from step `warmup` to `last`."""
    later = [s for s in samples if s["step"] >= warmup and (last is None or s["step"] <= last)]
    roles = sorted({r for s in later for r in s["pss"]})
    out = {}
    for r in roles + ["total"]:
        pts = [(s["step"], (sum(s["pss"].values()) if r == "total" else s["pss"].get(r, 0)) / 2**20)
               for s in later if r == "total" or r in s["pss"]]
        k = slope(pts)
        if k is not None:
            out[r] = {"mib_per_100_steps": 100 * k, "mib_first": pts[0][1], "mib_last": pts[-1][1]}
    return out


def check(c: BenchSoakConfig) -> None:
    if c.steps <= c.warmup_steps + c.tail_steps + 50:
        raise ConfigError("steps must exceed warmup_steps + tail_steps by 50 or more (the fit "
                          "needs a span)")
    if c.tail_steps < 0:
        raise ConfigError("tail_steps must be >= 0")
    if c.period_s <= 0:
        raise ConfigError("period_s must be > 0")


def run(c: BenchSoakConfig, argv: list[str]) -> int:
    out = Path(c.out)
    run_dir = out.parent / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "jobs.train", "--config", c.config, f"train.steps={c.steps}",
           f"run.run_dir={run_dir}", "run.name=soak", "run.eval_before=false",
           "run.eval_after=false", *map(str, c.overrides)]
    steps_file = run_dir / "steps.jsonl"
    samples, t0 = [], time.time()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            step = sum(1 for _ in open(steps_file)) if steps_file.exists() else 0
            if step:
                samples.append({"t": time.time() - t0, "step": step, "pss": sample(root)})
                if len(samples) % 20 == 0:  # a soak cut short still leaves its samples
                    out.write_text(json.dumps({"argv": argv, "cmd": cmd, "partial": True,
                                               "samples": samples}))
            time.sleep(c.period_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the soak run failed (exit {proc.returncode}); see {out.with_suffix('.log')}")
    # Training only: the last samples catch the job tearing its processes down.
    g = growth(samples, c.warmup_steps, c.steps - c.tail_steps)
    tree = g["total"]["mib_per_100_steps"]
    report = {"argv": argv, "cmd": cmd, "steps": c.steps, "warmup_steps": c.warmup_steps,
              "tail_steps": c.tail_steps, "wall_s": time.time() - t0,
              "limit_mib_per_100_steps": c.limit_mib, "passed": tree <= c.limit_mib,
              "growth": g, "samples": samples}
    out.write_text(json.dumps(report, indent=2))
    worst = sorted(((v["mib_per_100_steps"], r) for r, v in g.items() if r != "total"), reverse=True)[:4]
    print(f"bench_soak {c.steps} steps in {report['wall_s']:.0f} s: whole tree "
          f"{tree:+.1f} MiB per 100 steps ({g['total']['mib_first']:.0f} -> "
          f"{g['total']['mib_last']:.0f} MiB), {'PASS' if report['passed'] else 'FAIL'} "
          f"(limit {c.limit_mib:g}); most growth: "
          + ", ".join(f"{r} {k:+.1f}" for k, r in worst) + f" -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_soak", __doc__.splitlines()[0],
                      BenchSoakConfig, check, run)


if __name__ == "__main__":
    sys.exit(main())
