"""Curves of a run as a PNG: reward and staleness per step, throughput, and the
policy's entropy with the engine/trainer mismatch where the records have them.

Drawn from the surviving step records (steps.jsonl through `lineage`), so the same
function serves the job at its end, the notebooks and the benchmarks. It draws on a
bare `Figure` (no pyplot): that needs no display on cluster nodes and leaves the
backend of a notebook that imports it alone.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def plot_curves(steps: list[dict], out: str | Path, title: str = "") -> Path:
    """Panels over the trained version: mean reward, staleness (mean and max of the
    batch), training tokens/s, and (records that have them) token entropy beside the
    k3 engine/trainer mismatch. Returns the PNG's path."""
    if not steps:
        raise ValueError("no step records to plot")
    x = [s["version"] for s in steps]
    nan = float("nan")  # a step with no finite value is a gap in the curve
    policy = any(s.get("entropy") is not None for s in steps)
    fig = Figure(figsize=(7, 10.5 if policy else 8))
    axes = fig.subplots(4 if policy else 3, 1, sharex=True)
    ax_r, ax_s, ax_t = axes[:3]
    ax_r.plot(x, [nan if s["reward_mean"] is None else s["reward_mean"] for s in steps], marker=".")
    ax_r.set_ylabel("reward (batch mean)")
    ax_s.plot(x, [s["staleness_mean"] for s in steps], marker=".", label="mean")
    ax_s.plot(x, [s["staleness_max"] for s in steps], marker=".", label="max")
    ax_s.set_ylabel("staleness (versions)")
    ax_s.legend()
    ax_t.plot(x, [s["n_tokens"] / s["step_s"] if s.get("step_s") else 0.0 for s in steps],
              marker=".")
    ax_t.set_ylabel("trained tokens/s")
    if policy:
        ax_e = axes[3]
        ax_e.plot(x, [nan if s.get("entropy") is None else s["entropy"] for s in steps],
                  marker=".", color="C0")
        ax_e.set_ylabel("token entropy", color="C0")
        ax_m = ax_e.twinx()  # another scale: the mismatch is orders of magnitude smaller
        ax_m.plot(x, [nan if s.get("mismatch_k3") is None else s["mismatch_k3"] for s in steps],
                  marker=".", color="C3")
        ax_m.set_ylabel("mismatch KL (k3)", color="C3")
    axes[-1].set_xlabel("policy version")
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
