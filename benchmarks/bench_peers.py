"""Benchmark: our quickstart against TRL's GRPOTrainer on the same task, side by side.

    python -m benchmarks.bench_peers [seeds=[0,1,2]] [steps=40] [out=runs/bench_peers.json]

Per seed, interleaved (TRL, ours, TRL, ours, ...) so the machine's drift hits both alike:
TRL 1.16 through `benchmarks/peer_trl.py` (its settings: the quickstart's, listed there) and
our training job on conf/quickstart.yaml, each in its own process tree, one at a time.
Both save their model every `save_every` steps; afterwards every saved model is graded
by our own evaluator (greedy, the 256 held-out problems), so the same code decides
both accuracies. Per run: training seconds as each system counts them (TRL:
`trainer.train()`; ours: Ray Train's `fit()`, worker start-up included) and trained
samples/s over them; seconds from launching the command to the last step; greedy
accuracy of each saved model with the seconds from launch it was reached at, so time
to `target_accuracy` counts every start-up; final accuracy; the peak PSS of the whole
process tree (sampled every 0.5 s). Per system the mean over seeds; then the ratios
the issue's goals are about.

TRL is installed on first use, with --no-deps, into .peers/site from
requirements-peers.txt (its own dependencies there too), never into the main venv.
Writes the JSON report, a markdown table next to it, and one summary line.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from areal_ray.config import ConfigError, opt
from jobs.cli import bench_main

REPO = Path(__file__).resolve().parent.parent
PEERS_SITE = REPO / ".peers" / "site"


@dataclass
class BenchPeersConfig:
    seeds: list = opt([0, 1, 2], "seeds, one run of each system per seed")
    steps: int = opt(40, "optimizer steps of every run")
    save_every: int = opt(10, "models saved (and graded) every N steps")
    target_accuracy: float = opt(0.8, "greedy held-out accuracy the time-to-accuracy goal is about")
    trl_threads: int = opt(2, "torch threads of the TRL process (its default here is 2)")
    ours: list = opt([], "extra key=value overrides of our run (e.g. algo.eta=0)")
    run_config: str = opt("conf/quickstart.yaml", "our run config (TRL takes its settings from it)")
    out: str = opt("runs/bench_peers.json", "JSON report (a .md table is written next to it)")


def ensure_trl() -> Path:
    """TRL and its dependencies in .peers/site (pinned in requirements-peers.txt)."""
    marker = PEERS_SITE / ".installed"
    req = REPO / "requirements-peers.txt"
    if not marker.exists() or marker.read_text() != req.read_text():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(PEERS_SITE), "-r", str(req)], check=True)
        marker.write_text(req.read_text())
    return PEERS_SITE


class TreePeak:
    """Peak PSS (bytes) of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, period_s: float = 0.5):
        self.root, self.period_s, self.peak = psutil.Process(pid), period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.period_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_tree(cmd: list[str], env: dict, log: Path) -> tuple[float, int]:
    """Run `cmd` to the end; (wall seconds, peak PSS of its process tree)."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        peak = TreePeak(proc.pid)
        rc = proc.wait()
        peak_bytes = peak.stop()
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {rc}); see {log}")
    return time.perf_counter() - t0, peak_bytes


def run_trl(c: BenchPeersConfig, seed: int, root: Path) -> dict:
    out = root / f"trl-seed{seed}"
    launched = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ensure_trl()), str(REPO)]),
               TOKENIZERS_PARALLELISM="false")
    wall, peak = run_tree([sys.executable, "-m", "benchmarks.peer_trl", f"seed={seed}", f"steps={c.steps}",
                           f"save_every={c.save_every}", f"threads={c.trl_threads}",
                           f"config={c.run_config}", f"out={out}"], env, root / f"trl-seed{seed}.log")
    res = json.loads((out / "result.json").read_text())
    for m in res["models"]:
        m["t_launch"] = m["t_wall"] - launched
    return {"system": "trl", "seed": seed, "wall_s": wall, "peak_pss_gib": peak / 2**30,
            "train_s": res["train_s"], "last_step_s": res["steps"][-1]["t_wall"] - launched,
            "n_samples": res["n_samples"], "models": res["models"]}


def run_ours(c: BenchPeersConfig, seed: int, root: Path) -> dict:
    run_dir = root / f"ours-seed{seed}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launched = time.time()
    wall, peak = run_tree([sys.executable, "-m", "jobs.train", "--config", c.run_config,
                           f"train.seed={seed}", f"train.steps={c.steps}",
                           f"train.checkpoint_every={c.save_every}", f"run.run_dir={run_dir}",
                           f"run.name=peers-ours-{seed}",
                           f"run.mlflow_tracking_uri=sqlite:///{root / 'mlflow.db'}",
                           # graded afterwards by the bench, as TRL's models are: no
                           # in-run evaluation, which TRL's run does not do either
                           "run.eval_before=false", "run.eval_after=false", *c.ours],
                          env, root / f"ours-seed{seed}.log")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    wall_of = {s["version"]: s["t_wall"] for s in steps if "t_wall" in s}
    models = []
    from areal_ray.train.checkpoint import checkpoint_dirs
    for ckpt in checkpoint_dirs(run_dir / "train"):
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if state["version"] < c.steps and (ckpt / "model").exists():
            models.append({"step": state["version"], "path": str(ckpt / "model"),
                           "t_launch": wall_of[state["version"]] - launched})
    models.append({"step": c.steps, "path": summary["final_model"],
                   "t_launch": wall_of[c.steps] - launched})
    return {"system": "ours", "seed": seed, "wall_s": wall, "peak_pss_gib": peak / 2**30,
            "train_s": summary["train_s"], "last_step_s": wall_of[c.steps] - launched,
            "n_samples": sum(s["n_samples"] for s in steps if "n_samples" in s),
            "models": sorted(models, key=lambda m: m["step"])}


def grade(run: dict, c: BenchPeersConfig) -> None:
    """Greedy held-out accuracy of every saved model of `run`, by our evaluator."""
    from ray import serve

    from areal_ray.config import load_config
    from areal_ray.data.prompts import eval_rows
    from areal_ray.run.eval import evaluate
    from areal_ray.run.job import init_ray
    from areal_ray.task.tokenizer import load_tokenizer
    from deployments.rollout import build_app
    cfg = load_config(c.run_config, ["rollout.backend=hf"])
    init_ray(cfg)
    serve.start(proxy_location="Disabled")
    rows = eval_rows(cfg.task)
    for m in run["models"]:
        app = f"peers-eval-{run['system']}-{run['seed']}-{m['step']}"
        handle = serve.run(build_app(cfg, m["path"]), name=app, route_prefix=None)
        try:
            m["accuracy"] = evaluate(handle, load_tokenizer(m["path"]), rows, cfg)["accuracy"]
        finally:
            serve.delete(app)
    run["final_accuracy"] = run["models"][-1]["accuracy"]
    run["samples_per_s"] = run["n_samples"] / run["train_s"]
    run["end_to_end_samples_per_s"] = run["n_samples"] / run["last_step_s"]
    hit = [m["t_launch"] for m in run["models"] if m["accuracy"] >= c.target_accuracy]
    run["time_to_target_s"] = min(hit) if hit else None


SUMMARY_KEYS = ("samples_per_s", "end_to_end_samples_per_s", "train_s", "last_step_s",
                "final_accuracy", "time_to_target_s", "peak_pss_gib", "wall_s")


def summarize(runs: list[dict]) -> dict:
    out = {}
    for system in ("trl", "ours"):
        mine = [r for r in runs if r["system"] == system]
        agg = {}
        for k in SUMMARY_KEYS:
            vals = [r[k] for r in mine if r.get(k) is not None]
            agg[k] = statistics.mean(vals) if vals else None
        agg["reached_target"] = sum(r.get("time_to_target_s") is not None for r in mine)
        agg["runs"] = len(mine)
        out[system] = agg
    t, o = out["trl"], out["ours"]
    out["ratios"] = {
        "samples_per_s_ours_over_trl": o["samples_per_s"] / t["samples_per_s"],
        "end_to_end_samples_per_s_ours_over_trl": o["end_to_end_samples_per_s"] / t["end_to_end_samples_per_s"],
        "peak_pss_ours_over_trl": o["peak_pss_gib"] / t["peak_pss_gib"],
        "final_accuracy_ours_minus_trl": o["final_accuracy"] - t["final_accuracy"],
        "time_to_target_ours_over_trl": (o["time_to_target_s"] / t["time_to_target_s"]
                                         if o["time_to_target_s"] and t["time_to_target_s"] else None)}
    return out


def table(report: dict) -> str:
    lines = ["| system | seed | train s | samples/s | launch to last step s | final acc | "
             "launch to target s | peak PSS GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        tt = f"{r['time_to_target_s']:.0f}" if r.get("time_to_target_s") is not None else "not reached"
        lines.append(f"| {r['system']} | {r['seed']} | {r['train_s']:.1f} | {r['samples_per_s']:.1f} | "
                     f"{r['last_step_s']:.1f} | {r['final_accuracy']:.3f} | {tt} | {r['peak_pss_gib']:.2f} |")
    return "\n".join(lines) + "\n\n```\n" + json.dumps(report["summary"], indent=1) + "\n```\n"


def _secs(v) -> str:
    return f"{v:.0f} s" if v is not None else "not reached"


def check(c: BenchPeersConfig) -> None:
    if not c.seeds or c.steps < 1 or c.save_every < 0 or not 0 < c.target_accuracy <= 1:
        raise ConfigError("seeds must be non-empty, steps >= 1, save_every >= 0, target_accuracy in (0, 1]")


def run(c: BenchPeersConfig, argv) -> dict:
    root = (Path(c.out).with_suffix("") / time.strftime("%Y%m%d-%H%M%S")).absolute()  # runs, logs
    root.mkdir(parents=True, exist_ok=True)
    ensure_trl()
    runs = []
    for seed in c.seeds:
        for fn in (run_trl, run_ours):
            r = fn(c, seed, root)
            print(f"[bench_peers] {r['system']} seed {seed}: {r['train_s']:.1f} s training, "
                  f"peak PSS {r['peak_pss_gib']:.2f} GiB", flush=True)
            runs.append(r)
    for r in runs:  # grading is outside every timed window
        grade(r, c)
    report = {"argv": argv, "config": {k: getattr(c, k) for k in c.__dataclass_fields__},
              "runs": runs, "summary": summarize(runs)}
    Path(c.out).write_text(json.dumps(report, indent=1))
    Path(c.out).with_suffix(".md").write_text(table(report))
    s, r = report["summary"], report["summary"]["ratios"]
    print(f"[bench_peers] ours {s['ours']['samples_per_s']:.1f} vs TRL {s['trl']['samples_per_s']:.1f} "
          f"samples/s ({r['samples_per_s_ours_over_trl']:.2f}x); final acc {s['ours']['final_accuracy']:.3f} "
          f"vs {s['trl']['final_accuracy']:.3f}; peak PSS {s['ours']['peak_pss_gib']:.2f} vs "
          f"{s['trl']['peak_pss_gib']:.2f} GiB ({r['peak_pss_ours_over_trl']:.1f}x); launch to "
          f"{c.target_accuracy:.0%} accuracy: ours {_secs(s['ours']['time_to_target_s'])}, "
          f"TRL {_secs(s['trl']['time_to_target_s'])} -> {c.out}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_peers", __doc__.split("\n\n")[0],
                      BenchPeersConfig, check, run)


if __name__ == "__main__":
    sys.exit(main())
