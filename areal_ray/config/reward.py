"""`reward.*`: the reward actor pool (Ray Data actors) and the bounds of each check."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.choices import Choice
from areal_ray.config.judge import JudgeConfig, RewardModelConfig
from areal_ray.config.section import opt, require, section


class SandboxMode(Choice):
    """How model-written code is isolated (areal_ray/reward/sandbox.py)."""
    auto = "auto"  # the isolation this machine has (bubblewrap); refused without it
    bwrap = "bwrap"  # bubblewrap; refused without it
    rlimits = "rlimits"  # no isolation, resource limits only: an explicit opt-in


@dataclass(kw_only=True)
class RewardConfig:
    checkers: dict = opt({}, "extra reward checkers: verifier name (a row's `verifier` field) -> dotted path of a checker class; math, code and chain are built in")
    min_actors: int = opt(1, "reward actor pool: fewest actors (Ray Data autoscaling)")
    max_actors: int = opt(2, "reward actor pool: most actors")
    scale_down: bool = opt(False, "let Ray Data retire idle reward actors mid-run (off: bursty load makes it churn)")
    num_cpus: float = opt(0.25, "CPUs reserved per reward actor")
    timeout_s: float = opt(5.0, "wall-clock bound of one math check; past it the reward is 0")
    code_timeout_s: float = opt(30.0, "wall-clock bound of one code check (all its tests)")
    code_time_limit_s: float = opt(2.0, "per-test wall and CPU limit of sandboxed code")
    code_memory_limit_mb: int = opt(512, "per-test address-space limit of sandboxed code")
    sandbox: SandboxMode = opt(SandboxMode.auto, "isolation of model-written code (code rewards, the python tool): auto or bwrap = bubblewrap, required (Debian: apt-get install bubblewrap); rlimits = no network or filesystem isolation, resource limits only (an explicit opt-in)")

    judge: JudgeConfig = section(JudgeConfig, "the generative judge, served (verifier judge; areal_ray/judge/)")
    reward_model: RewardModelConfig = section(RewardModelConfig, "the scalar reward model, served (verifier reward_model)")

    def check(self) -> None:
        require(1 <= self.min_actors <= self.max_actors, "need 1 <= reward.min_actors <= reward.max_actors")
        both = set(self.judge.instead_of) & set(self.reward_model.instead_of) \
            if self.judge.enabled and self.reward_model.enabled else set()
        require(not both, f"verifier(s) {sorted(both)} are in both reward.judge.instead_of and "
                          "reward.reward_model.instead_of: one served reward grades a verifier")
