"""Benchmark: start-up and memory of the prompt stream at 10k/100k/1M prompts.

    python -m benchmarks.bench_stream [out=runs/bench_stream.json] [sizes=[10000,100000,1000000]]
                                [consume=2000] [baseline_max=100000]

For each size a jsonl dataset of that many arithmetic prompts is written once (under
runs/bench_stream_data, not timed). Each measurement runs in a fresh process that
starts a local Ray cluster and times, from Ray being up:
- `open_s`: the job's part before the pipeline exists (the stream counts rows and
  checks the first of them; the previous release read and checked every row);
- `first_row_s`: until the first prompt comes out of a rollout-like stage (an async
  actor pool taking one block per call, as the rollout stage does);
then consumes `consume` prompts and reports the job process's PSS (the driver side),
the peak PSS of the whole process tree (Ray's processes included) and how many
prompts were read but not yet taken (sampled every 100). `stream` is
this release's path (Ray Data read tasks); `from_items` is the previous release's
(every row read into the job, one block per prompt), measured up to `baseline_max`
prompts because it is linear in the dataset. With `job_steps=N` it also runs the real
quickstart job on each dataset (N steps, no eval) and times launch -> first trained
step. Writes JSON and prints one line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from areal_ray.config import ConfigError, opt
from benchmarks.bench_peers import TreeMeter
from jobs.cli import bench_main

REPO = Path(__file__).resolve().parent.parent
MODES = ("stream", "from_items")


@dataclass
class BenchStreamConfig:
    out: str = opt("runs/bench_stream.json", "JSON report path")
    sizes: list = opt([10_000, 100_000, 1_000_000], "dataset sizes (prompts)")
    consume: int = opt(2000, "prompts consumed after the first, for the memory figures")
    baseline_max: int = opt(100_000, "largest size the previous release's path is measured at")
    data_dir: str = opt("runs/bench_stream_data", "where the datasets are written (reused)")
    job_steps: int = opt(0, "also run the real quickstart job on each dataset for this many steps and time launch -> first step (0: skip)")


def dataset(root: Path, n: int) -> Path:
    path = root / f"prompts-{n}.jsonl"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for i in range(n):
                a, b = i % 977, i % 89
                # the embedded task's form, so the tiny model can train on it (job_steps)
                f.write(json.dumps({"uid": f"p{i}", "prompt": f"{a}+{b}=",
                                    "answer": str(a + b)}) + "\n")
        tmp.rename(path)
    return path


class Taker:
    """Stands in for the rollout stage: an async actor, one block per call, asking the
    run's driver to admit each prompt (a gate that never fills: this measures the
    stream, not the trainer)."""

    def __init__(self, driver_name: str, generation: int):
        import ray
        self.driver, self.generation = ray.get_actor(driver_name), generation

    async def __call__(self, batch):
        for pos in batch["pos"]:
            if await self.driver.acquire.remote(int(pos), self.generation) is not None:
                await self.driver.finish.remote(self.generation)
        return {"pos": batch["pos"], "rows": [len(batch["pos"])] * len(batch["pos"])}


def _pss(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().pss


def measure(path: str, n: int, mode: str, consume: int, queue) -> None:
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    from areal_ray.data.prompts import read_prompts
    from areal_ray.data.stream import file_stream, prompt_dataset
    from areal_ray.driver import Driver

    tree = TreeMeter(os.getpid(), period_s=0.25)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    DataContext.get_current().enable_progress_bars = False
    t_ray = time.perf_counter()
    driver = Driver.options(name="bench-stream-driver").remote(10**6, 1, 24)
    generation = ray.get(driver.begin_generation.remote())
    ray.get(driver.restore.remote(0))
    if mode == "stream":
        ds = prompt_dataset(file_stream(path, n, 0, 10_000), "bench-stream-driver",
                            ray.get_runtime_context().namespace, generation)
    else:
        rows = read_prompts(path)
        keep = ("uid", "prompt", "answer", "verifier")
        ds = ray.data.from_items([{"pos": i, **{k: str(r[k]) for k in keep}}
                                  for i, r in enumerate(rows)], override_num_blocks=len(rows))
    t_open = time.perf_counter()
    ds = ds.map_batches(Taker, batch_size=None, num_cpus=0,
                        fn_constructor_kwargs={"driver_name": "bench-stream-driver",
                                               "generation": generation},
                        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=24,
                                                  max_concurrent_calls_per_actor=24))
    it = iter(ds.iter_rows())
    first = next(it)
    t_first = time.perf_counter()
    pss_first = _pss(os.getpid())
    taken, big, ahead = 1, int(first["rows"] > 1), 0
    for row in it:
        taken += 1
        big += int(row["rows"] > 1)
        if taken % 100 == 0:
            ahead = max(ahead, ray.get(driver.read_state.remote())["ahead"])
        if taken > consume:
            break
    t_end = time.perf_counter()
    queue.put({"mode": mode, "n": n, "open_s": t_open - t_ray, "first_row_s": t_first - t_ray,
               "rows_per_s_after_first": (taken - 1) / (t_end - t_first),
               "rows_in_multi_row_blocks": big, "taken": taken,
               # prompts read but not taken (stream only: the old path read them all)
               "max_read_ahead": ahead if mode == "stream" else n - taken,
               "job_pss_mib_at_first": pss_first / 2**20,
               "job_pss_mib_after": _pss(os.getpid()) / 2**20,
               "tree_peak_pss_mib": tree.stop().peak / 2**20})
    del it  # end the iteration before Ray goes
    ray.shutdown()


def run_one(path: Path, n: int, mode: str, consume: int) -> dict:
    from benchmarks import bench_stream  # not __main__: Ray workers import Taker by module name
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=bench_stream.measure, args=(str(path), n, mode, consume, q))
    p.start()
    while p.is_alive() or not q.empty():
        try:
            result = q.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty; poll the child again
            continue
        p.join(timeout=120)
        return result
    raise RuntimeError(f"the {mode} measurement at n={n} failed (exit {p.exitcode}); see above")


def run_job(path: Path, n: int, steps: int, root: Path) -> dict:
    """The quickstart job on the dataset: launch -> first trained step, peak PSS."""
    from benchmarks.bench_peers import run_tree
    run_dir = root / f"job-{n}-{time.strftime('%H%M%S')}"
    launched = time.time()
    wall, meter = run_tree([sys.executable, "-m", "jobs.train", "--config", "conf/quickstart.yaml",
                           f"task.train_path={path.resolve()}", f"train.steps={steps}",
                           f"run.run_dir={run_dir}", "run.eval_before=false", "run.eval_after=false",
                           f"run.mlflow_tracking_uri=sqlite:///{root / 'mlflow.db'}"],
                          dict(os.environ, PYTHONPATH=str(REPO)), root / f"job-{n}.log")
    first = json.loads((run_dir / "steps.jsonl").read_text().splitlines()[0])
    return {"mode": "job", "n": n, "steps": steps, "wall_s": wall,
            "launch_to_first_step_s": first["t_wall"] - launched, "tree_peak_pss_mib": meter.peak / 2**20}


def check(c: BenchStreamConfig) -> None:
    if not c.sizes or any(int(s) < 1 for s in c.sizes):
        raise ConfigError("sizes: a list of dataset sizes >= 1")
    if c.consume < 1:
        raise ConfigError("consume must be >= 1")


def run(c: BenchStreamConfig, argv: list[str]) -> int:
    out, data = Path(c.out), Path(c.data_dir)
    sizes = [int(s) for s in c.sizes]
    results = []
    for n in sizes:
        path = dataset(data, n)
        for mode in MODES:
            if mode == "from_items" and n > c.baseline_max:
                continue
            r = run_one(path, n, mode, min(c.consume, n - 1))
            print(f"  {mode:10s} n={n:>8,}: open {r['open_s']:.1f} s, first row "
                  f"{r['first_row_s']:.1f} s, job PSS {r['job_pss_mib_after']:.0f} MiB, "
                  f"tree peak {r['tree_peak_pss_mib']:.0f} MiB, read ahead "
                  f"{r['max_read_ahead']:,}", flush=True)
            results.append(r)
    for n in sizes if c.job_steps else []:
        r = run_job(dataset(data, n), n, c.job_steps, out.parent)
        print(f"  job        n={n:>8,}: launch -> first step {r['launch_to_first_step_s']:.1f} s, "
              f"tree peak {r['tree_peak_pss_mib']:.0f} MiB", flush=True)
        results.append(r)
    report = {"machine": f"{platform.node()} {os.cpu_count()} cpus", "argv": argv,
              "python": sys.version.split()[0], "results": results}
    out.write_text(json.dumps(report, indent=2))
    line = "; ".join(f"{r['mode']} {r['n']:,}: first row {r['first_row_s']:.1f} s, job "
                     f"{r['job_pss_mib_after']:.0f} MiB, read ahead {r['max_read_ahead']:,}"
                     if r["mode"] != "job" else
                     f"job {r['n']:,}: first step {r['launch_to_first_step_s']:.1f} s from launch"
                     for r in results)
    print(f"bench_stream {line} -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_stream", __doc__.splitlines()[0],
                      BenchStreamConfig, check, run)


if __name__ == "__main__":
    sys.exit(main())
