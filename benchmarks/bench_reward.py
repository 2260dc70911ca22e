"""Benchmark: reward throughput of the reward stage vs pool size, math and code.

    python -m benchmarks.bench_reward [out=runs/bench_reward.json] [sizes=1,2,4] [groups=48]
                                [sandbox=auto]

Each measurement streams `groups` prompt groups (8 samples each) through the real
Ray Data reward stage (RewardStage on an ActorPoolStrategy of fixed size) and reports
rewards/s in steady state (from the first finished group on; with the pool's start-up
too) and the checking time added per sample (measured inside the stage). Math
samples are worked solutions, half right; code samples are programs for the embedded
problems, half right, each run against 4 tests in the sandbox, in the mode `sandbox`
names (as `reward.sandbox` of a run: without bubblewrap, auto refuses before anything
is measured and rlimits must be asked for). Writes JSON and prints one summary line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.data import ActorPoolStrategy, DataContext

from areal_ray.config import opt
from areal_ray.config.reward import SandboxMode
from areal_ray.reward.pool import RewardStage
from areal_ray.reward.sandbox import ENV as SANDBOX_ENV
from areal_ray.reward.sandbox import SandboxUnavailable, isolation
from areal_ray.task.arith import make_split
from areal_ray.task.code_problems import PROBLEMS, make_rows
from areal_ray.types import Group, Sample
from jobs.cli import job_config

GROUP = 8


def math_groups(n: int) -> list[dict]:
    rows = []
    for t, p in enumerate(make_split(seed=5, n=n)):
        wrong = p.solution.replace("\\boxed{" + p.answer + "}", "\\boxed{" + str(int(p.answer) + 1) + "}")
        samples = [Sample([1], [2], [0.0], [0], "stop", text=p.solution if i % 2 else wrong)
                   for i in range(GROUP)]
        rows.append(Group(t, f"m{t}", p.prompt, p.answer, "math", 0, samples).to_row())
    return rows


def code_groups(n: int) -> list[dict]:
    problems, rows = make_rows(seed=3), []
    for t in range(n):
        row, ref = problems[t % len(problems)], PROBLEMS[t % len(PROBLEMS)].reference
        right, wrong = f"```python\n{ref}```", "```python\nprint(input())\n```"
        samples = [Sample([1], [2], [0.0], [0], "stop", text=right if i % 2 else wrong)
                   for i in range(GROUP)]
        rows.append(Group(t, row["uid"], row["prompt"], json.dumps(row["tests"]), "code", 0,
                          samples).to_row())
    return rows


def measure(rows: list[dict], pool_size: int) -> dict:
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        RewardStage, batch_size=None, num_cpus=0.25, compute=ActorPoolStrategy(size=pool_size))
    t0 = time.perf_counter()
    out, arrivals = [], []
    for r in ds.iter_rows():
        out.append(Group.from_row(r))
        arrivals.append(time.perf_counter())
    wall = time.perf_counter() - t0
    n = sum(len(g.samples) for g in out)
    check_s = sum(g.meta["reward_s"] for g in out)
    # Steady state: from the first finished group on, so the pool's start-up is excluded.
    steady = (n - len(out[0].samples)) / max(arrivals[-1] - arrivals[0], 1e-9)
    return {"pool_size": pool_size, "samples": n, "wall_s": wall, "rewards_per_s": steady,
            "rewards_per_s_incl_startup": n / wall, "check_ms_per_sample": 1000 * check_s / n,
            "reward_mean": sum(s.reward for g in out for s in g.samples) / n}


@dataclass
class BenchRewardConfig:
    out: str = opt("runs/bench_reward.json", "JSON report path")
    sizes: list = opt([1, 2, 4], "reward pool sizes to measure")
    groups: int = opt(48, "math groups per measurement (half as many code groups)")
    sandbox: SandboxMode = opt(SandboxMode.auto, "how the code samples run, as reward.sandbox")


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m benchmarks.bench_reward", __doc__.splitlines()[0], BenchRewardConfig)
    if c is None:
        return 2
    out, sizes, n_groups = Path(c.out), [int(s) for s in c.sizes], c.groups
    try:  # before anything runs: a code measurement without its sandbox measures nothing
        mode = isolation(c.sandbox.value)
    except SandboxUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    repo = str(Path(__file__).resolve().parent.parent)
    ray.init(address="local", num_cpus=max(4, max(sizes)), include_dashboard=False,
             logging_level="ERROR", runtime_env={"env_vars": {
                 "PYTHONPATH": repo, SANDBOX_ENV: c.sandbox.value}})
    DataContext.get_current().enable_progress_bars = False
    workloads = {"math": math_groups(n_groups), "code": code_groups(n_groups // 2)}
    measure(workloads["math"][:4], 1)  # warm-up: worker processes, imports
    results = {kind: [measure(rows, k) for k in sizes] for kind, rows in workloads.items()}
    report = {"machine": f"{os.cpu_count()} cores", "isolation": mode,
              "samples_per_group": GROUP, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    ray.shutdown()
    line = "; ".join(f"{kind} " + ", ".join(f"pool {r['pool_size']}: {r['rewards_per_s']:.0f}/s "
                                            f"({r['check_ms_per_sample']:.1f} ms/sample)" for r in rs)
                     for kind, rs in results.items())
    print(f"bench_reward [{report['machine']}, {report['isolation']}] {line} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
