"""`eval.*`: the standalone evaluation job (`python -m jobs.eval`, pass@k)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.section import opt, require


@dataclass(kw_only=True)
class EvalConfig:
    model_path: str = opt("", "jobs.eval: model to evaluate (a run's final_model/ or a checkpoint's model/); empty: model.path")
    k: int = opt(8, "jobs.eval: samples per problem for sampled pass@1 and pass@k")
    temperature: float = opt(1.0, "jobs.eval: sampling temperature of the pass@k samples (greedy pass@1 is reported too)")
    out: str = opt("", "jobs.eval: JSON report path; empty: runs/eval-<name>-<time>.json")

    def check(self) -> None:
        require(self.k >= 1, "eval.k must be >= 1")
        require(self.temperature > 0, "eval.temperature must be > 0 (greedy pass@1 is always reported)")
