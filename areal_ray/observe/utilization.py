"""Where a run's time went: trainer and rollout idle fractions, steady-state
throughput and output-length tails, computed from what a run records anyway.

These are the figures that say whether asynchrony pays (benchmarks/bench_async.py) and
they land in every run's summary.json:

* trainer idle: the share of the trainer's step time spent waiting for a batch
  (`wait_s` of each step record over its `step_s`);
* rollout idle: the share of wall time a replica's engine had nothing to run. Each
  replica reports its engine's cumulative busy clock to the driver every few
  seconds (`Driver.report_load`); the fraction is taken between the first and last
  report inside the training window. Engines without a busy clock (SGLang) count a
  report as idle when nothing is running or queued. `interval_rates` is the one
  place this is computed: the replicas' live gauge (metrics.py) uses it over their
  last interval, the run's summary over the training window;
* steady state: from the end of the first step to the end of the last. The first
  step also carries the start-up of Ray Data, the trainer and the first rollouts,
  the same at every eta, which would otherwise blur a comparison of short runs.
"""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    s = sorted(values)
    return float(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))])


def length_stats(lengths: list[int]) -> dict:
    """The shape of the output-length distribution: its median, tail and maximum."""
    if not lengths:
        return {}
    return {"output_len_mean": sum(lengths) / len(lengths),
            "output_len_p50": percentile(lengths, 50), "output_len_p90": percentile(lengths, 90),
            "output_len_p99": percentile(lengths, 99), "output_len_max": float(max(lengths))}


def steady_state(steps: list[dict]) -> dict:
    """Throughput and trainer idle fraction from the end of the first step on.

    `steps`: the run's step records in order (with `time_s`, `step_s`, `wait_s`,
    `n_samples`, `n_tokens`). Needs two steps; returns {} with fewer."""
    if len(steps) < 2:
        return {}
    later = steps[1:]
    window = steps[-1]["time_s"] - steps[0]["time_s"]
    step_s = sum(s["step_s"] for s in later)
    return {
        "steady_s": window,
        "steady_samples_per_s": sum(s["n_samples"] for s in later) / window,
        "steady_tokens_per_s": sum(s["n_tokens"] for s in later) / window,
        "trainer_idle_fraction": sum(s["wait_s"] for s in later) / step_s,
        "train_compute_s_per_step": sum(s.get("train_s", 0.0) for s in later) / len(later),
        "step_s_mean": step_s / len(later),
    }


def thin(reports: list[dict]) -> list[dict]:
    """Every other report, the first and the last kept: the driver's bound on what it
    keeps per replica. Repeated, the spacing doubles as the run gets longer, so the
    idle fraction (from the reports at the window's ends, or their share of idle ones)
    keeps the same precision relative to the run's length."""
    return reports[:-1:2] + reports[-1:]


def interval_rates(first: dict, last: dict, samples: list[dict]) -> dict:
    """{idle_fraction, tokens_per_s} of one replica's engine between two of its load
    reports (each {time, tokens, busy_s (or None), running, queued}); {} for an empty
    interval. Idle is what the busy clock did not count when both reports carry one;
    without a clock, the share of `samples` (the reports over the interval) in which
    nothing was running or queued."""
    dt = last["time"] - first["time"]
    if dt <= 0:
        return {}
    if first.get("busy_s") is not None and last.get("busy_s") is not None:
        idle = max(0.0, 1.0 - (last["busy_s"] - first["busy_s"]) / dt)
    else:
        idle = sum(r["running"] == 0 and r["queued"] == 0 for r in samples) / len(samples)
    # every generated token counts, the aborted tails of interrupted requests too
    return {"idle_fraction": idle, "tokens_per_s": (last["tokens"] - first["tokens"]) / dt}


def rollout_idle(reports: dict[str, list[dict]], t0: float, t1: float) -> dict:
    """Rollout idle fraction and generation tokens/s between wall times t0 and t1:
    each replica's `interval_rates` over its reports inside the window, idle weighted
    by the time each covers, tokens/s summed over replicas.

    `reports`: replica id -> its load reports (any order). Replicas with fewer than
    two reports in the window are left out; returns {} when none has two."""
    idle_s = covered_s = tokens_per_s = 0.0
    for rows in reports.values():
        inside = sorted((r for r in rows if t0 <= r["time"] <= t1), key=lambda r: r["time"])
        if len(inside) < 2:
            continue
        rates = interval_rates(inside[0], inside[-1], inside)
        if not rates:
            continue
        dt = inside[-1]["time"] - inside[0]["time"]
        idle_s += dt * rates["idle_fraction"]
        covered_s += dt
        tokens_per_s += rates["tokens_per_s"]
    if covered_s <= 0:
        return {}
    return {"rollout_idle_fraction": idle_s / covered_s, "generation_tokens_per_s": tokens_per_s}
