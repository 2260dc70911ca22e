"""Benchmark: our training job against TRL's GRPOTrainer on the same task, side by side.

    python -m benchmarks.bench_peers [seeds=[0,1,2]] [steps=40] [out=runs/bench_peers.json]
    python -m benchmarks.bench_peers --config conf/bench_peers_longtail.yaml   # the long-tailed task

Per seed, interleaved (TRL, ours at each eta, TRL, ...) so the machine's drift hits
every system alike: TRL 1.16 through `benchmarks/peer_trl.py` (its settings are taken
from `run_config`, listed there) and our training job on `run_config` once per entry
of `etas`, each in its own process tree, one at a time. The quickstart is the default
`run_config`; conf/longtail.yaml is the workload with long-tailed outputs. Every run
saves its model every `save_every` steps; afterwards every saved model is graded by
our own evaluator (greedy, the config's held-out problems), so the same code decides
every accuracy. Per run: training seconds as each system counts them (TRL:
`trainer.train()`; ours: Ray Train's `fit()`, worker start-up included) and trained
samples/s over them, and in steady state (end of the first step to the end of the
last); seconds from launching the command to the first and the last step; greedy
accuracy of each saved model with the seconds from launch it was reached at, so time
to `target_accuracy` counts every start-up; final accuracy; the peak PSS and the CPU
seconds of the whole process tree (sampled every 0.5 s), the latter per steady step;
the rollout idle share (ours: the engine's busy clock, areal_ray/observe/utilization.py;
TRL: the share of the steady window outside `generate`, plus the share of the row-steps
`generate` spent on rows that had already ended, as it pads every batch to its
longest answer). Per system the mean over seeds; then each of our arms against TRL.

TRL's asynchronous trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`, in 1.16)
is not a system here: it cannot run without a CUDA GPU and a vLLM server (it trains
through FlashAttention-3 tree attention, generates through a vLLM server's HTTP API
and pushes weights over NCCL; docs/benchmarks.md gives the lines).

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
from tempfile import TemporaryDirectory

import psutil

from areal_ray.config import ConfigError, opt
from benchmarks.bench_soak import role
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
    etas: list = opt([], "our arms, one run per seed at each algo.eta (empty: the run config's eta)")
    ours: list = opt([], "extra key=value overrides of every one of our runs")
    run_config: str = opt("conf/quickstart.yaml", "our run config (TRL takes its settings from it)")
    grade_past_target: bool = opt(True, "grade the saved models between the first to reach "
                                  "target_accuracy and the final one (false: skip them, faster)")
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


class TreeMeter:
    """Peak PSS (bytes) and CPU seconds of a process and all its descendants, sampled
    in a thread, and the peak's PSS by process role (bench_soak.role: where the memory
    is). A process's CPU time is the last value seen for its pid, so one that
    exits keeps what it had used up to its last sample (up to `period_s` of it lost)."""

    def __init__(self, pid: int, period_s: float = 0.5):
        self.root, self.period_s, self.peak = psutil.Process(pid), period_s, 0
        self.peak_by_role: dict[str, int] = {}
        self.cpu_of: dict[tuple[int, float], float] = {}  # (pid, create time) -> user + system s
        self.series: list[tuple[float, float]] = []  # (wall clock, tree CPU s so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total, roles = 0, {}
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    with p.oneshot():
                        pss = p.memory_full_info().pss
                        t = p.cpu_times()
                        self.cpu_of[(p.pid, p.create_time())] = t.user + t.system
                        name = role(p)
                except psutil.Error:
                    continue
                total += pss
                roles[name] = roles.get(name, 0) + pss
            if total > self.peak:
                self.peak, self.peak_by_role = total, roles
            self.series.append((time.time(), sum(self.cpu_of.values())))
            self._stop.wait(self.period_s)

    def stop(self) -> TreeMeter:
        self._stop.set()
        self._thread.join()
        return self

    def cpu_at(self, t_wall: float) -> float:
        """Tree CPU seconds used by wall time `t_wall` (the last sample at or before it)."""
        before = [cpu for t, cpu in self.series if t <= t_wall]
        return before[-1] if before else 0.0


def run_tree(cmd: list[str], env: dict, log: Path) -> tuple[float, TreeMeter]:
    """Run `cmd` to the end; (wall seconds, the meter of its process tree)."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        meter = TreeMeter(proc.pid)
        rc = proc.wait()
        meter.stop()
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {rc}); see {log}")
    return time.perf_counter() - t0, meter


def tree_fields(wall: float, meter: TreeMeter, step_walls: list[float]) -> dict:
    """What the meter says about a run whose steps ended at `step_walls` (wall clock)."""
    out = {"wall_s": wall, "peak_pss_gib": meter.peak / 2**30, "cpu_s": meter.cpu_at(float("inf")),
           "peak_pss_mib_by_process": {g: round(b / 2**20) for g, b in sorted(
               meter.peak_by_role.items(), key=lambda kv: -kv[1])}}
    if len(step_walls) >= 2:  # the steady window: end of the first step to the end of the last
        window_cpu = meter.cpu_at(step_walls[-1]) - meter.cpu_at(step_walls[0])
        out["steady_cpu_s_per_step"] = window_cpu / (len(step_walls) - 1)
        out["steady_cores_busy"] = window_cpu / (step_walls[-1] - step_walls[0])
    return out


def run_trl(c: BenchPeersConfig, seed: int, root: Path) -> dict:
    out = root / f"trl-seed{seed}"
    launched = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ensure_trl()), str(REPO)]),
               TOKENIZERS_PARALLELISM="false")
    wall, meter = run_tree([sys.executable, "-m", "benchmarks.peer_trl", f"seed={seed}", f"steps={c.steps}",
                            f"save_every={c.save_every}", f"threads={c.trl_threads}",
                            f"config={c.run_config}", f"out={out}"], env, root / f"trl-seed{seed}.log")
    res = json.loads((out / "result.json").read_text())
    for m in res["models"]:
        m["t_launch"] = m["t_wall"] - launched
    steps = res["steps"]
    walls = [s["t_wall"] for s in steps]
    per_step = res["n_samples"] / len(steps)
    run = {"system": "trl", "seed": seed, **tree_fields(wall, meter, walls),
           "train_s": res["train_s"], "first_step_s": walls[0] - launched, "last_step_s": walls[-1] - launched,
           "n_samples": res["n_samples"], "models": res["models"]}
    if len(steps) >= 2:
        window = walls[-1] - walls[0]
        run["steady_samples_per_s"] = per_step * (len(steps) - 1) / window
        # the generator is idle whenever it is not inside `generate` (training, scoring)
        run["rollout_idle_fraction"] = 1 - sum(s["generate_s"] for s in steps[1:]) / window
    # `generate` computes every row until the batch's longest ends: the share of its
    # row-steps spent on rows that had already ended
    lens = [(s["mean_len"], s["max_len"]) for s in steps if s.get("max_len")]
    if lens:
        run["padded_row_step_fraction"] = 1 - sum(m for m, _ in lens) / sum(x for _, x in lens)
    return run


def our_etas(c: BenchPeersConfig) -> list[int]:
    """Our arms' etas: `etas`, else the run config's own (with `ours` applied)."""
    if c.etas:
        return list(c.etas)
    from areal_ray.config import load_config
    return [load_config(c.run_config, list(c.ours)).algo.eta]


def run_ours(c: BenchPeersConfig, seed: int, root: Path, eta: int) -> dict:
    system = f"ours-eta{eta}"
    run_dir = root / f"{system}-seed{seed}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launched = time.time()
    wall, meter = run_tree([sys.executable, "-m", "jobs.train", "--config", c.run_config,
                            f"train.seed={seed}", f"train.steps={c.steps}",
                            f"train.checkpoint_every={c.save_every}", f"run.run_dir={run_dir}",
                            f"run.name=peers-{system}-{seed}",
                            f"run.mlflow_tracking_uri=sqlite:///{root / 'mlflow.db'}",
                            # graded afterwards by the bench, as TRL's models are: no
                            # in-run evaluation, which TRL's run does not do either
                            "run.eval_before=false", "run.eval_after=false",
                            # every saved model is graded: none may be pruned
                            "run.keep_checkpoints=0", *c.ours, f"algo.eta={eta}"],
                           env, root / f"{system}-seed{seed}.log")
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
    walls = [wall_of[v] for v in sorted(wall_of)]
    return {"system": system, "eta": eta, "seed": seed, **tree_fields(wall, meter, walls),
            "train_s": summary["train_s"], "first_step_s": walls[0] - launched,
            "last_step_s": wall_of[c.steps] - launched,
            "n_samples": sum(s["n_samples"] for s in steps if "n_samples" in s),
            **{k: summary[k] for k in ("steady_samples_per_s", "rollout_idle_fraction",
                                       "trainer_idle_fraction", "train_compute_s_per_step",
                                       "output_len_p50", "output_len_p90", "output_len_max")
               if summary.get(k) is not None},
            "models": sorted(models, key=lambda m: m["step"])}


def grade(run: dict, c: BenchPeersConfig) -> None:
    """Greedy held-out accuracy of every saved model of `run`, by our evaluator: one
    rollout app for the run, serving its first model, then each next one pushed into it
    as the trainer pushes (a replica starts in ~9 s here; a push of the tiny model takes
    milliseconds), checked by the replica's weights digest before it is graded."""
    import uuid

    import ray
    from ray import serve
    from transformers import AutoModelForCausalLM

    from areal_ray.cluster.placement import delete_app
    from areal_ray.config import WeightsConfig, load_config
    from areal_ray.data.prompts import eval_rows
    from areal_ray.driver import Driver
    from areal_ray.run.eval import evaluate
    from areal_ray.run.job import init_ray
    from areal_ray.task.tokenizer import load_tokenizer
    from areal_ray.weights.encoding import digest
    from areal_ray.weights.push import WeightPusher
    from deployments.rollout import build_app
    cfg = load_config(c.run_config, ["rollout.backend=hf"])
    init_ray(cfg)
    serve.start(proxy_location="Disabled")
    rows = eval_rows(cfg.task)
    tag = uuid.uuid4().hex[:6]
    driver_name, app = f"peers-eval-driver-{tag}", f"peers-eval-{run['system']}-{run['seed']}-{tag}"
    driver = Driver.options(name=driver_name).remote(eta=1, batch_groups=1, push_timeout_s=120.0)
    first = run["models"][0]["path"]
    handle = serve.run(build_app(cfg, first, driver_name, ray.get_runtime_context().namespace),
                       name=app, route_prefix=None)
    try:
        with TemporaryDirectory() as weights_dir:
            pusher = WeightPusher(WeightsConfig(path="object_store"), driver, 0, weights_dir)
            reached, version = False, 0
            try:
                for i, m in enumerate(run["models"]):
                    if reached and not c.grade_past_target and i < len(run["models"]) - 1:
                        m["accuracy"] = None  # not graded: the time to target is known already
                        continue
                    if m["path"] != first:
                        model = AutoModelForCausalLM.from_pretrained(m["path"])
                        version += 1
                        pusher.push(model, version)
                        served = handle.weights_digest.remote().result(timeout_s=120)
                        if (served["version"], served["digest"]) != (version, digest(model.state_dict())):
                            raise RuntimeError(f"the eval replica does not serve {m['path']}: {served}")
                    m["accuracy"] = evaluate(handle, load_tokenizer(m["path"]), rows, cfg)["accuracy"]
                    reached = reached or m["accuracy"] >= c.target_accuracy
            finally:
                pusher.close()  # also when a push or the check failed
    finally:
        delete_app(app)
        ray.kill(driver)
    run["final_accuracy"] = run["models"][-1]["accuracy"]
    run["samples_per_s"] = run["n_samples"] / run["train_s"]
    run["end_to_end_samples_per_s"] = run["n_samples"] / run["last_step_s"]
    hit = [m["t_launch"] for m in run["models"]
           if m["accuracy"] is not None and m["accuracy"] >= c.target_accuracy]
    run["time_to_target_s"] = min(hit) if hit else None


SUMMARY_KEYS = ("samples_per_s", "steady_samples_per_s", "end_to_end_samples_per_s", "train_s",
                "first_step_s", "last_step_s", "final_accuracy", "time_to_target_s", "peak_pss_gib",
                "wall_s", "cpu_s", "steady_cpu_s_per_step", "steady_cores_busy", "rollout_idle_fraction",
                "padded_row_step_fraction", "trainer_idle_fraction", "train_compute_s_per_step")
# ours / TRL for each of these (time to target: only where both reached it on average)
RATIO_KEYS = ("samples_per_s", "steady_samples_per_s", "end_to_end_samples_per_s", "peak_pss_gib",
              "steady_cpu_s_per_step", "time_to_target_s")


def summarize(runs: list[dict]) -> dict:
    out = {}
    for system in dict.fromkeys(r["system"] for r in runs):  # in run order: trl first
        mine = [r for r in runs if r["system"] == system]
        agg = {}
        for k in SUMMARY_KEYS:
            vals = [r[k] for r in mine if r.get(k) is not None]
            agg[k] = statistics.mean(vals) if vals else None
        agg["reached_target"] = sum(r.get("time_to_target_s") is not None for r in mine)
        agg["runs"] = len(mine)
        out[system] = agg
    t = out["trl"]
    out["vs_trl"] = {
        system: {**{f"{k}_ours_over_trl": (o[k] / t[k] if o[k] and t[k] else None) for k in RATIO_KEYS},
                 "final_accuracy_ours_minus_trl": o["final_accuracy"] - t["final_accuracy"]}
        for system, o in out.items() if system.startswith("ours")}
    return out


def _f(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def table(report: dict) -> str:
    """Per system (mean over seeds), then per run."""
    head = ("| system | samples/s (steady) | launch to first / last step s | final acc | "
            "launch to target s | peak PSS GiB | CPU-s per steady step | rollout idle |")
    lines = ["means over seeds, target accuracy "
             f"{report['config']['target_accuracy']}:", "", head, "|---|---|---|---|---|---|---|---|"]
    rows = [(s, a) for s, a in report["summary"].items() if s != "vs_trl"]
    rows += [(f"{r['system']} seed {r['seed']}", r) for r in report["runs"]]
    for name, a in rows:
        reached = (f" ({a['reached_target']}/{a['runs']})" if "runs" in a else "")
        idle = _f(a.get("rollout_idle_fraction"), "{:.0%}")
        if a.get("padded_row_step_fraction") is not None:
            idle += f" (+{a['padded_row_step_fraction']:.0%} padded rows)"
        lines.append(f"| {name} | {_f(a.get('samples_per_s'))} ({_f(a.get('steady_samples_per_s'))}) | "
                     f"{_f(a.get('first_step_s'), '{:.0f}')} / {_f(a.get('last_step_s'), '{:.0f}')} | "
                     f"{_f(a.get('final_accuracy'), '{:.3f}')} | "
                     f"{_f(a.get('time_to_target_s'), '{:.0f}', 'not reached')}{reached} | "
                     f"{_f(a.get('peak_pss_gib'), '{:.2f}')} | {_f(a.get('steady_cpu_s_per_step'), '{:.2f}')} | "
                     f"{idle} |")
    return "\n".join(lines) + "\n\n```\n" + json.dumps(report["summary"], indent=1) + "\n```\n"


def summary_line(report: dict, c: BenchPeersConfig) -> str:
    s = report["summary"]
    t = s["trl"]
    arms = "; ".join(
        f"{name} {o['samples_per_s']:.1f} ({r['samples_per_s_ours_over_trl']:.2f}x, steady "
        f"{_f(r['steady_samples_per_s_ours_over_trl'], '{:.2f}x')}), acc {o['final_accuracy']:.3f}, "
        f"to target {_f(o['time_to_target_s'], '{:.0f} s', 'not reached')}, "
        f"peak {o['peak_pss_gib']:.2f} GiB ({r['peak_pss_gib_ours_over_trl']:.1f}x)"
        for name, o, r in ((n, s[n], s["vs_trl"][n]) for n in s["vs_trl"]))
    return (f"[bench_peers] {Path(c.run_config).stem}: TRL {t['samples_per_s']:.1f} samples/s (steady "
            f"{_f(t['steady_samples_per_s'])}), acc {t['final_accuracy']:.3f}, to {c.target_accuracy:.0%} "
            f"{_f(t['time_to_target_s'], '{:.0f} s', 'not reached')}, peak {t['peak_pss_gib']:.2f} GiB; "
            f"{arms} -> {c.out}")


def check(c: BenchPeersConfig) -> None:
    if not c.seeds or c.steps < 1 or c.save_every < 0 or not 0 < c.target_accuracy <= 1:
        raise ConfigError("seeds must be non-empty, steps >= 1, save_every >= 0, target_accuracy in (0, 1]")
    etas = list(c.etas)
    if any(not isinstance(e, int) or e < 0 for e in etas) or len(set(etas)) != len(etas):
        raise ConfigError(f"etas must be distinct integers >= 0, got {etas}")


def run(c: BenchPeersConfig, argv) -> dict:
    root = (Path(c.out).with_suffix("") / time.strftime("%Y%m%d-%H%M%S")).absolute()  # runs, logs
    root.mkdir(parents=True, exist_ok=True)
    ensure_trl()
    etas = our_etas(c)
    runs = []
    import ray
    from ray import serve
    owned = not ray.is_initialized()  # else the caller's cluster (a test's) grades every run
    for seed in c.seeds:
        for eta in (None, *etas):  # TRL, then each of our arms
            r = run_trl(c, seed, root) if eta is None else run_ours(c, seed, root, eta)
            print(f"[bench_peers] {r['system']} seed {seed}: {r['train_s']:.1f} s training, "
                  f"peak PSS {r['peak_pss_gib']:.2f} GiB", flush=True)
            grade(r, c)  # between runs, outside every timed window
            if owned:  # the grading cluster goes before the next run starts
                serve.shutdown()
                ray.shutdown()
            runs.append(r)
            report = write_report(c, argv, runs)  # after every run: a bench cut short keeps its runs
    print(summary_line(report, c), flush=True)
    return report


def write_report(c: BenchPeersConfig, argv, runs: list[dict]) -> dict:
    report = {"argv": argv, "config": {k: getattr(c, k) for k in c.__dataclass_fields__},
              "runs": runs, "summary": summarize(runs)}
    Path(c.out).write_text(json.dumps(report, indent=1))
    Path(c.out).with_suffix(".md").write_text(table(report))
    return report


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_peers", __doc__.split("\n\n")[0],
                      BenchPeersConfig, check, run)


if __name__ == "__main__":
    sys.exit(main())
