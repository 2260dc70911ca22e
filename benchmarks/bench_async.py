"""Benchmark: asynchronous vs synchronous RL throughput, and the staleness ablation.

AReaL's two central results, on one task, one model, the same resources and the
same number of trained samples in every arm.

    python -m benchmarks.bench_async --config conf/bench_async.yaml
    python -m benchmarks.bench_async --config conf/bench_async.yaml etas=[0,4] base.train.steps=20

For each eta in `etas` and each objective in `objectives` it runs the real training
job (`run_training`, one after another on one Ray cluster):

* eta = 0 is the synchronous system: the staleness gate admits step t+1's rollouts
  only once version t+1 is served, so generation waits for training and training
  for the slowest generation of its batch;
* `decoupled`: decoupled PPO (proximal policy recomputed by the trainer);
  `ppo`: plain PPO clipped around the behaviour logprobs (`algo.loss.decoupled=false`).

Per arm: trained samples/s and tokens/s (steady state from the end of the first
step, and end to end over the training phase), wall time, trainer idle fraction,
rollout idle fraction, greedy accuracy on the held-out split after training, the
staleness reached, and the output-length distribution (its tail is what makes a
synchronous system idle). Ratios are taken against eta = 0 of the same objective.

Writes the JSON report, a PNG (throughput and idle fractions vs eta; accuracy vs eta
for both objectives), a markdown table, and prints one summary line.
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_ray.config import Config, ConfigError, opt, to_dict, validate
from jobs.cli import bench_main, write_report

OBJECTIVES = ("decoupled", "ppo")
# figures copied from each arm's summary.json into the report
ARM_KEYS = ("steady_samples_per_s", "steady_tokens_per_s", "samples_per_s", "tokens_per_s",
            "wall_s", "train_s", "trainer_idle_fraction", "rollout_idle_fraction",
            "generation_tokens_per_s", "train_compute_s_per_step", "step_s_mean",
            "eval_accuracy_after", "max_staleness", "mean_staleness", "n_samples", "n_tokens",
            "output_len_mean", "output_len_p50", "output_len_p90", "output_len_p99",
            "output_len_max")
# higher is better: eta / eta0; wall time: eta0 / eta (a speed-up either way)
RATIO_KEYS = ("steady_samples_per_s", "steady_tokens_per_s", "samples_per_s", "tokens_per_s")


@dataclass
class BenchAsyncConfig:
    etas: list = opt([0, 1, 2, 4, 8], "staleness bounds to run; must include 0 (the synchronous baseline)")
    objectives: list = opt(list(OBJECTIVES), "decoupled (decoupled PPO) and/or ppo (plain PPO on behaviour logprobs)")
    out: str = opt("runs/bench_async/report.json", "JSON report; the PNG, the markdown table and the arms' run dirs go next to it")
    base: Config = field(default_factory=Config, metadata={"help": "the run config every arm shares"})


def check(c: BenchAsyncConfig) -> BenchAsyncConfig:
    etas, objectives = list(c.etas), list(c.objectives)
    if 0 not in etas:
        raise ConfigError("etas must include 0: every ratio is taken against the synchronous run")
    if any(not isinstance(e, int) or e < 0 for e in etas) or len(set(etas)) != len(etas):
        raise ConfigError(f"etas must be distinct integers >= 0, got {etas}")
    if not objectives or any(o not in OBJECTIVES for o in objectives):
        raise ConfigError(f"objectives must be a non-empty subset of {OBJECTIVES}, got {objectives}")
    validate(c.base)
    return c


def arm_config(base: Config, eta: int, objective: str, run_dir: Path) -> Config:
    """One arm: the shared config with its eta and objective, evaluated after training."""
    cfg = copy.deepcopy(base)
    cfg.algo.eta = eta
    cfg.algo.loss.decoupled = objective == "decoupled"
    cfg.run.name = f"{base.run.name}-eta{eta}-{objective}"
    cfg.run.run_dir = str(run_dir)
    cfg.run.eval_after = True
    return validate(cfg)


def ratios(arms: list[dict]) -> None:
    """Adds to each arm its speed-ups and accuracy change against eta 0 (same objective)."""
    sync = {a["objective"]: a for a in arms if a["eta"] == 0}
    for a in arms:
        s = sync.get(a["objective"])
        if s is None:
            continue
        r = {k: a[k] / s[k] for k in RATIO_KEYS if a.get(k) and s.get(k)}
        if a.get("wall_s") and s.get("wall_s"):
            r["wall_s"] = s["wall_s"] / a["wall_s"]
        a["vs_eta0"] = r
        if a.get("eval_accuracy_after") is not None and s.get("eval_accuracy_after") is not None:
            a["accuracy_points_vs_eta0"] = 100 * (a["eval_accuracy_after"] - s["eval_accuracy_after"])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    import ray
    import torch
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, torch {torch.__version__}, ray {ray.__version__}"


def _pct(v) -> str:
    # a run too short for two replica load reports inside its window has no rollout idle
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _num(v) -> float:
    return float("nan") if v is None else v


def table(report: dict) -> str:
    """docs/benchmarks.md's markdown table: one row per arm."""
    head = ("| eta | objective | trained samples/s (steady) | vs eta 0 | end-to-end samples/s | "
            "wall s | trainer idle | rollout idle | accuracy after | vs eta 0 (points) | max staleness |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in report["arms"]:
        r = a.get("vs_eta0", {})
        rows.append(
            f"| {a['eta']} | {a['objective']} | {a['steady_samples_per_s']:.1f} | "
            f"{r.get('steady_samples_per_s', float('nan')):.2f}x | {a['samples_per_s']:.1f} | "
            f"{a['wall_s']:.0f} | {_pct(a['trainer_idle_fraction'])} | "
            f"{_pct(a.get('rollout_idle_fraction'))} | "
            f"{a['eval_accuracy_after']:.3f} | {a.get('accuracy_points_vs_eta0', 0.0):+.1f} | "
            f"{a['max_staleness']} |")
    return "\n".join(rows)


def plot(report: dict, out: Path) -> Path:
    """Throughput ratio and idle fractions vs eta (decoupled arms, else the first
    objective), and final accuracy vs eta for every objective."""
    from matplotlib.figure import Figure
    arms = report["arms"]
    main_obj = "decoupled" if any(a["objective"] == "decoupled" for a in arms) else arms[0]["objective"]
    main = sorted((a for a in arms if a["objective"] == main_obj), key=lambda a: a["eta"])
    etas = [a["eta"] for a in main]
    fig = Figure(figsize=(13, 4))
    ax_t, ax_i, ax_a = fig.subplots(1, 3)
    ax_t.plot(etas, [a["vs_eta0"].get("steady_samples_per_s", 0) for a in main], marker="o",
              label="steady state")
    ax_t.plot(etas, [a["vs_eta0"].get("samples_per_s", 0) for a in main], marker="s",
              label="end to end")
    ax_t.axhline(1.0, color="gray", lw=0.8)
    ax_t.set(xlabel="eta (max staleness)", ylabel="trained samples/s vs eta 0",
             title=f"throughput ({main_obj})")
    ax_t.legend()
    ax_i.plot(etas, [_num(a["trainer_idle_fraction"]) for a in main], marker="o", label="trainer")
    ax_i.plot(etas, [_num(a.get("rollout_idle_fraction")) for a in main], marker="s",
              label="rollout")
    ax_i.set(xlabel="eta (max staleness)", ylabel="idle fraction", ylim=(0, 1), title="idle time")
    ax_i.legend()
    for obj in dict.fromkeys(a["objective"] for a in arms):
        mine = sorted((a for a in arms if a["objective"] == obj), key=lambda a: a["eta"])
        ax_a.plot([a["eta"] for a in mine], [a["eval_accuracy_after"] for a in mine], marker="o",
                  label={"decoupled": "decoupled PPO", "ppo": "plain PPO"}[obj])
    ax_a.set(xlabel="eta (max staleness)", ylabel="held-out accuracy after training",
             title="staleness ablation")
    ax_a.legend()
    for ax in (ax_t, ax_i, ax_a):
        ax.grid(alpha=0.3)
        ax.set_xticks(etas)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def summary_line(report: dict) -> str:
    arms = report["arms"]
    dec = {a["eta"]: a for a in arms if a["objective"] == report["headline_objective"]}
    top = max(e for e in dec)
    pick = 4 if 4 in dec else top
    a = dec[pick]
    parts = [f"bench_async [{report['machine']}; {report['arms'][0]['n_samples']} samples per arm, "
             f"output lengths p50/p99/max {a['output_len_p50']:.0f}/{a['output_len_p99']:.0f}/"
             f"{a['output_len_max']:.0f}]",
             f"eta {pick} vs 0 ({report['headline_objective']}): "
             f"{a['vs_eta0'].get('steady_samples_per_s', float('nan')):.2f}x trained samples/s steady, "
             f"{a['vs_eta0'].get('samples_per_s', float('nan')):.2f}x end to end, "
             f"accuracy {a['eval_accuracy_after']:.3f} vs {dec[0]['eval_accuracy_after']:.3f}"]
    for obj in dict.fromkeys(x["objective"] for x in arms):
        accs = sorted((x["eta"], x["eval_accuracy_after"]) for x in arms if x["objective"] == obj)
        parts.append(f"{obj} accuracy by eta " + " ".join(f"{e}:{v:.3f}" for e, v in accs))
    return "; ".join(parts)


def run_bench(c: BenchAsyncConfig, argv: list[str]) -> dict:
    from areal_ray.observe.tracking import lineage, read_events
    from areal_ray.run.job import run_training

    out = Path(c.out)
    root = out.parent / f"{out.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    arms = []
    for eta in c.etas:  # objectives interleaved, so machine drift hits both alike
        for objective in c.objectives:
            cfg = arm_config(c.base, eta, objective, (root / f"eta{eta}-{objective}").absolute())
            print(f"[bench_async] eta {eta} {objective}: {cfg.train.steps} steps -> {cfg.run.run_dir}",
                  flush=True)
            summary = run_training(cfg)
            steps = lineage(read_events(Path(cfg.run.run_dir) / "steps.jsonl"))
            arms.append({"eta": eta, "objective": objective, "run_dir": cfg.run.run_dir,
                         **{k: summary.get(k) for k in ARM_KEYS},
                         "staleness_per_step": [s["staleness_mean"] for s in steps]})
    ratios(arms)
    headline = "decoupled" if "decoupled" in c.objectives else c.objectives[0]
    report = {"machine": machine(), "command": "python -m benchmarks.bench_async " + " ".join(argv),
              "base": to_dict(c.base), "headline_objective": headline, "arms": arms}
    report["png"] = str(plot(report, out.with_suffix(".png")))
    report["table_md"] = str(out.with_suffix(".md"))
    out.with_suffix(".md").write_text(table(report) + "\n")
    return write_report(report, out, summary_line)


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, "python -m benchmarks.bench_async", __doc__.splitlines()[0],
                      BenchAsyncConfig, check, run_bench)


if __name__ == "__main__":
    sys.exit(main())
