"""Live run metrics for the Ray dashboard, through `ray.util.metrics`.

Ray exports them from every process that records them, so each value is recorded
where it is known first-hand instead of being relayed:

* the driver actor records what a trained step tells (version, samples, reward,
  staleness, weight-push phases, training tokens/s, trainer wait, policy entropy,
  engine/trainer mismatch, the share of tokens a correction masked) and the sizes of
  the rollout service and the reward pool, which it tracks anyway;
* every rollout replica samples its own engine (requests running and queued,
  generation tokens/s, idle fraction) every few seconds;
* the job's process, which polls the driver's admission counters for the console,
  records how long they have not moved (seconds since progress).

Prometheus (and the dashboard's Metrics view) shows each name with Ray's `ray_`
prefix, e.g. `ray_areal_version`. Every series carries a `run` tag (`run.name`), so
several runs on one cluster stay apart; replica series add a `replica` tag.
The metric objects are made lazily: constructing one needs a connected Ray worker.
"""

from __future__ import annotations

import time

from areal_ray.observe.utilization import interval_rates

# Staleness is a small integer: one bucket per value up to 8, then 16 and beyond.
STALENESS_BOUNDARIES = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 16.5]
PUSH_PHASES = {"gather": "push_gather_s", "transfer": "push_transfer_s",
               "load": "push_load_s", "total": "push_total_s"}
# gauge -> the step record's key it shows (train/step.py measures them)
STEP_GAUGES = {"areal_policy_entropy": "entropy", "areal_mismatch_kl": "mismatch_k3",
               "areal_correction_masked_fraction": "correction_masked_frac"}

# name -> (kind, description, extra tag keys); docs/running.md's metrics table lists these.
METRICS = {
    "areal_version": ("gauge", "policy version the trainer has published", ()),
    "areal_samples_trained": ("counter", "samples trained on", ()),
    "areal_reward_mean": ("gauge", "mean reward of the last trained batch", ()),
    "areal_staleness": ("histogram", "staleness of each trained sample (versions)", ()),
    "areal_weight_push_seconds": ("gauge", "last weight push, per phase (gather, transfer, load, total)", ("phase",)),
    "areal_train_tokens_per_s": ("gauge", "trained tokens per second of the last step", ()),
    "areal_trainer_wait_fraction": ("gauge", "share of the last step the trainer waited for samples", ()),
    "areal_policy_entropy": ("gauge", "mean token entropy of the policy on the last step's trained tokens", ()),
    "areal_mismatch_kl": ("gauge", "engine/trainer mismatch of the last step: k3 KL(pi_behav || pi_trainer) per token", ()),
    "areal_correction_masked_fraction": ("gauge", "share of the last step's trained tokens the mismatch correction (or the behaviour cap) masked", ()),
    "areal_rollout_replicas": ("gauge", "rollout replicas registered with the driver", ()),
    "areal_reward_pool_actors": ("gauge", "live reward actors (Ray Data autoscaling pool)", ()),
    "areal_rollout_requests": ("gauge", "generation requests on a replica, by state (running, queued)", ("replica", "state")),
    "areal_generation_tokens_per_s": ("gauge", "tokens generated per second by a replica", ("replica",)),
    "areal_rollout_idle_fraction": ("gauge", "share of time a replica's engine had nothing to run", ("replica",)),
    "areal_seconds_since_progress": ("gauge", "seconds since the pipeline last made progress (an episode admitted or finished, a prompt read or taken, a step trained); 0 once the run has closed", ()),
    "areal_router_outstanding_tokens": ("gauge", "generation budget the least-tokens router sent to a replica and has not seen end (per calling process)", ("replica",)),
}


class _Registry:
    """One metric object per name per process: each construction registers the metric
    with Ray's exporter again."""

    def __init__(self):
        self._objs: dict[str, object] = {}

    def get(self, name: str):
        if name not in self._objs:
            from ray.util.metrics import Counter, Gauge, Histogram
            kind, desc, extra = METRICS[name]
            tags = ("run",) + extra
            if kind == "gauge":
                self._objs[name] = Gauge(name, description=desc, tag_keys=tags)
            elif kind == "counter":
                self._objs[name] = Counter(name, description=desc, tag_keys=tags)
            else:
                self._objs[name] = Histogram(name, description=desc,
                                             boundaries=STALENESS_BOUNDARIES, tag_keys=tags)
        return self._objs[name]


_registry = _Registry()


class DriverMetrics:
    """What the driver actor records: one call per trained step, plus pool sizes."""

    def __init__(self, run: str):
        self.tags = {"run": run or "areal"}

    def step(self, rec: dict) -> None:
        g = _registry.get
        g("areal_version").set(rec["version"], tags=self.tags)
        g("areal_samples_trained").inc(rec["n_samples"], tags=self.tags)
        if rec["reward_mean"] is not None:  # None: no finite reward in the batch
            g("areal_reward_mean").set(rec["reward_mean"], tags=self.tags)
        hist = g("areal_staleness")
        for value, count in (rec.get("staleness_hist") or {}).items():
            for _ in range(int(count)):
                hist.observe(float(value), tags=self.tags)
        for phase, key in PUSH_PHASES.items():
            if rec.get(key) is not None:
                g("areal_weight_push_seconds").set(rec[key], tags={**self.tags, "phase": phase})
        for name, key in STEP_GAUGES.items():
            if rec.get(key) is not None:  # None: not measured this step
                g(name).set(rec[key], tags=self.tags)
        if rec.get("step_s"):
            g("areal_train_tokens_per_s").set(rec["n_tokens"] / rec["step_s"], tags=self.tags)
            g("areal_trainer_wait_fraction").set(min(1.0, rec.get("wait_s", 0.0) / rec["step_s"]),
                                                 tags=self.tags)

    def replicas(self, n: int) -> None:
        _registry.get("areal_rollout_replicas").set(n, tags=self.tags)

    def reward_actors(self, n: int) -> None:
        _registry.get("areal_reward_pool_actors").set(n, tags=self.tags)


class JobMetrics:
    """What the job's own process records: how long the pipeline has stood still, from
    the driver's admission counters it polls for the console's stall line
    (observe/progress.py: `Stall`), so a dashboard shows a silent run as it happens."""

    def __init__(self, run: str):
        self.tags = {"run": run or "areal"}

    def since_progress(self, seconds: float) -> None:
        _registry.get("areal_seconds_since_progress").set(seconds, tags=self.tags)


class RouterMetrics:
    """What a least-tokens router records in the process that routes: each replica's
    outstanding budget, as it changes (rollout/router.py)."""

    def __init__(self, run: str):
        self.run = run or "areal"

    def outstanding(self, replica: str, tokens: int) -> None:
        _registry.get("areal_router_outstanding_tokens").set(
            tokens, tags={"run": self.run, "replica": replica})


class ReplicaMetrics:
    """A rollout replica's sampler: `sample(engine.load())` every few seconds turns
    the engine's cumulative counters into rates over the last interval, computed as
    the run's summary computes them (utilization.interval_rates)."""

    SAMPLED = 16  # engines without a busy clock: idle share over this many samples

    def __init__(self, run: str, replica: str):
        self.tags = {"run": run or "areal", "replica": replica}
        self._recent: list[dict] = []  # the last SAMPLED load reports

    def sample(self, load: dict, now: float | None = None) -> dict:
        """Records and returns {running, queued, tokens_per_s, idle_fraction}."""
        now = time.monotonic() if now is None else now
        busy = load.get("busy_s")
        report = {"time": now, "tokens": float(load.get("tokens", 0)),
                  "busy_s": None if busy is None else float(busy),
                  "running": int(load.get("running", 0)), "queued": int(load.get("queued", 0))}
        self._recent = (self._recent + [report])[-self.SAMPLED:]
        out = {"running": report["running"], "queued": report["queued"]}
        if len(self._recent) >= 2:
            out.update(interval_rates(self._recent[-2], report, self._recent))
        g = _registry.get
        for state in ("running", "queued"):
            g("areal_rollout_requests").set(out[state], tags={**self.tags, "state": state})
        if "tokens_per_s" in out:
            g("areal_generation_tokens_per_s").set(out["tokens_per_s"], tags=self.tags)
            g("areal_rollout_idle_fraction").set(out["idle_fraction"], tags=self.tags)
        return out
