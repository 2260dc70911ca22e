"""Curves of a run as a PNG: reward and staleness per step (and throughput).

Drawn from the surviving step records (steps.jsonl through `lineage`), so the same
function serves the job at its end, the notebooks and the benchmarks. It draws on a
bare `Figure` (no pyplot): that needs no display on cluster nodes and leaves the
backend of a notebook that imports it alone.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def plot_curves(steps: list[dict], out: str | Path, title: str = "") -> Path:
    """Three panels over the trained version: mean reward, staleness (mean and max of
    the batch), training tokens/s. Returns the PNG's path."""
    if not steps:
        raise ValueError("no step records to plot")
    x = [s["version"] for s in steps]
    fig = Figure(figsize=(7, 8))
    ax_r, ax_s, ax_t = fig.subplots(3, 1, sharex=True)
    nan = float("nan")  # a step with no finite reward is a gap in the curve
    ax_r.plot(x, [nan if s["reward_mean"] is None else s["reward_mean"] for s in steps], marker=".")
    ax_r.set_ylabel("reward (batch mean)")
    ax_s.plot(x, [s["staleness_mean"] for s in steps], marker=".", label="mean")
    ax_s.plot(x, [s["staleness_max"] for s in steps], marker=".", label="max")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.legend()
    ax_t.plot(x, [s["n_tokens"] / s["step_s"] if s.get("step_s") else 0.0 for s in steps],
              marker=".")
    ax_t.set_ylabel("trained tokens/s")
    ax_t.set_xlabel("policy version")
    for ax in (ax_r, ax_s, ax_t):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
