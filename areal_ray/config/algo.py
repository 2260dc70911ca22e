"""`algo.*`: the RL algorithm, one sub-section per concern.

`algo.eta` and `algo.batch_groups` stay at the top: they are the run's shape (how far
rollout may run ahead, how much one step trains on). The rest is grouped by what a
user tunes together: the PPO loss, advantages, the critic, the optimizer, reward
shaping, DAPO's dynamic filter and micro-batching.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.algo.corrections import CORRECTIONS, OFF, bounds
from areal_ray.algo.losses import DEFAULT as DEFAULT_LOSS
from areal_ray.config.choices import (
    AdvEstimator,
    AdvNorm,
    CorrectionMode,
    ImportanceLevel,
    KlEstimator,
    LrSchedule,
    PolicyLoss,
    ProxLogp,
)
from areal_ray.config.distill import DistillConfig
from areal_ray.config.section import opt, require, section

# Losses that apply `algo.loss.correction` (a loss of your own reads cfg.correction itself).
CORRECTION_LOSSES = ("decoupled_ppo", "cispo")


@dataclass(kw_only=True)
class CorrectionConfig:
    mode: CorrectionMode = opt(CorrectionMode(OFF), "training/inference mismatch correction of the behaviour weight w = pi_prox/pi_behav (docs/architecture.md): off (w with behav_imp_weight_cap) | token_tis | seq_tis | token_mis | seq_mis | geo_mis | icepop; any mode replaces behav_imp_weight_cap")
    is_threshold: float = opt(2.0, "TIS truncation C: weights above it are set to it (verl rollout_is_threshold, default 2.0); also the default mask upper bound of token_mis and seq_mis")
    rs_threshold: float | None = opt(None, "mask upper bound (verl rollout_rs_threshold); null: the mode's default (icepop 5, geo_mis 1.001, else is_threshold)")
    rs_threshold_lower: float | None = opt(None, "mask lower bound (verl rollout_rs_threshold_lower); null: icepop 0.5, else 1 / the upper bound")

    def check(self) -> None:
        require(self.is_threshold > 0, "algo.loss.correction.is_threshold must be > 0")
        if self.mode == OFF:
            return
        lower, upper = bounds(CORRECTIONS[self.mode], self.is_threshold, self.rs_threshold,
                              self.rs_threshold_lower)
        require(0 < lower <= upper, f"algo.loss.correction: the mask band [{lower}, {upper}] of "
                f"mode={self.mode} is empty or not positive; set rs_threshold_lower <= rs_threshold")


@dataclass(kw_only=True)
class LossConfig:
    name: PolicyLoss = opt(PolicyLoss(DEFAULT_LOSS), "the policy loss, by its name in areal_ray/algo/losses.py (docs/extending.md); decoupled_ppo: the (decoupled) PPO objective the keys below tune")
    decoupled: bool = opt(True, "decoupled PPO (recomputed proximal policy); false: plain PPO on behaviour logprobs")
    eps_clip: float = opt(0.2, "PPO clip epsilon (low side)")
    eps_clip_high: float | None = opt(None, "PPO clip epsilon, high side (DAPO clip-higher); null: eps_clip")
    dual_clip: float | None = opt(None, "dual-clip constant c > 1; null: off")
    behav_imp_weight_cap: float | None = opt(5.0, "mask tokens whose pi_prox/pi_behav exceeds this; null: no cap")
    importance_level: ImportanceLevel = opt(ImportanceLevel.token, "PPO ratio per token, or per sequence (GSPO: geometric mean over the sequence)")
    prox_logp: ProxLogp = opt(ProxLogp.recompute, "proximal logprobs with several minibatches: recompute (a no-grad forward) | loglinear (AReaL's approximation)")
    kl_coef: float = opt(0.0, "weight of a KL(pi_theta || pi_ref) loss term against the initial model; 0: no reference model")
    kl_estimator: KlEstimator = opt(KlEstimator.k3, "KL estimator for kl_coef: k1 | k2 | k3")
    entropy_coef: float = opt(0.0, "entropy bonus: loss -= entropy_coef * mean token entropy of the policy on trained tokens (with gradient); 0: off (the entropy is still recorded)")
    cispo_eps_low: float = opt(0.0, "name=cispo: the IS weight is clipped to [1 - cispo_eps_low, 1 + cispo_eps_high] (SkyRL's cispo_eps_clip_low, default 0)")
    cispo_eps_high: float = opt(5.0, "name=cispo: upper clip offset (SkyRL's cispo_eps_clip_high, default 5)")
    correction: CorrectionConfig = section(CorrectionConfig, "training/inference mismatch correction (TIS, masked IS, IcePop)")

    def check(self) -> None:
        require(self.dual_clip is None or self.dual_clip > 1, "algo.loss.dual_clip must be > 1 or null")
        require(self.kl_coef >= 0, "algo.loss.kl_coef must be >= 0")
        require(self.entropy_coef >= 0, "algo.loss.entropy_coef must be >= 0")
        require(0 <= self.cispo_eps_low <= 1 and self.cispo_eps_high >= 0,
                "algo.loss.cispo_eps_low must be in [0, 1] and cispo_eps_high >= 0")
        mode = self.correction.mode
        if mode != OFF:
            require(self.decoupled, f"algo.loss.correction.mode={mode} needs algo.loss.decoupled=true: "
                    "without the recomputed proximal policy the behaviour weight is 1 and there is "
                    "nothing to correct")
            require(self.name in CORRECTION_LOSSES,
                    f"algo.loss.correction.mode={mode} is applied by the losses {CORRECTION_LOSSES}, "
                    f"not by algo.loss.name={self.name}; set mode=off or one of those losses")
        if self.name == "cispo":
            require(self.importance_level == "token",
                    "algo.loss.name=cispo is a token-level objective; algo.loss.importance_level="
                    "sequence (GSPO) does not apply to it: use importance_level=token")
            require(self.dual_clip is None, "algo.loss.name=cispo has no dual clip: set "
                    "algo.loss.dual_clip=null (its clip is cispo_eps_low/cispo_eps_high)")


@dataclass(kw_only=True)
class AdvantageConfig:
    estimator: AdvEstimator = opt(AdvEstimator.grpo, "advantages: grpo (group mean/std), dr_grpo (group mean), rloo (leave-one-out), gae (PPO with a critic)")
    norm: AdvNorm = opt(AdvNorm.none, "extra advantage normalisation after the estimator: none | batch (mean/std over the batch's tokens)")
    gamma: float = opt(1.0, "GAE discount (estimator=gae)")
    gae_lambda: float = opt(1.0, "GAE lambda (estimator=gae)")


@dataclass(kw_only=True)
class CriticConfig:
    lr: float = opt(1e-4, "critic AdamW learning rate (algo.adv.estimator=gae)")
    value_clip: float | None = opt(0.2, "critic value clipping around the old values; null: off")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = opt(1e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    lr_warmup_steps: int = opt(0, "linear learning-rate warm-up steps")
    lr_schedule: LrSchedule = opt(LrSchedule.constant, "after warm-up: constant | linear | cosine (decay to 0 at train.steps)")
    ppo_minibatches: int = opt(1, "optimizer steps per training batch (PPO minibatches)")

    def check(self) -> None:
        require(self.lr_warmup_steps >= 0, "algo.optim.lr_warmup_steps must be >= 0")


@dataclass(kw_only=True)
class RewardShapingConfig:
    bias: float = opt(0.0, "reward transform r' = clip((r + bias) * scale)")
    scale: float = opt(1.0, "reward transform scale")
    clip: float | None = opt(None, "reward transform clip |r'| <= clip; null: none")
    overlong_tokens: int = opt(0, "DAPO overlong penalty ramp (tokens before rollout.max_new_tokens); 0: off")
    overlong_factor: float = opt(1.0, "DAPO overlong penalty at rollout.max_new_tokens")


@dataclass(kw_only=True)
class DynamicFilterConfig:
    enabled: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and roll out replacements")
    prompt_factor: float = opt(4.0, "prompts supplied per trained group when groups may be dropped: by the filter, or by a rollout.workflow of your own that rejects rows")

    def check(self) -> None:
        require(self.prompt_factor >= 1, "algo.dynamic_filter.prompt_factor must be >= 1")


@dataclass(kw_only=True)
class MicrobatchConfig:
    max_tokens: int = opt(8192, "token budget of one micro-batch; 0: the largest that fits train.gpu_memory_gib by the memory model (docs/gpu.md)")
    pack: bool = opt(True, "padding-free packed micro-batches (false: right-padded rows)")

    def check(self) -> None:
        require(self.max_tokens >= 0, "algo.microbatch.max_tokens must be >= 0")


@dataclass(kw_only=True)
class AlgoConfig:
    eta: int = opt(2, "staleness bound: max versions between a sample's oldest token and training; 0 = synchronous")
    batch_groups: int = opt(8, "prompt groups per training step (B)")
    loss: LossConfig = section(LossConfig, "the PPO objective")
    adv: AdvantageConfig = section(AdvantageConfig, "advantage estimation")
    critic: CriticConfig = section(CriticConfig, "the value model of adv.estimator=gae")
    optim: OptimConfig = section(OptimConfig, "the policy's optimizer and learning-rate schedule")
    reward_shaping: RewardShapingConfig = section(RewardShapingConfig, "transforms of the verifier's reward before advantages")
    dynamic_filter: DynamicFilterConfig = section(DynamicFilterConfig, "DAPO dynamic sampling")
    microbatch: MicrobatchConfig = section(MicrobatchConfig, "how a step's samples are cut into forward/backward passes")
    distill: DistillConfig = section(DistillConfig, "on-policy distillation from a served teacher (areal_ray/distill/)")

    def check(self) -> None:
        require(self.eta >= 0, "algo.eta must be >= 0")
        require(self.batch_groups >= 1, "algo.batch_groups must be >= 1")
        require(1 <= self.optim.ppo_minibatches <= self.batch_groups,
                "algo.optim.ppo_minibatches must be in [1, algo.batch_groups]")
        require(not self.distill.enabled or self.adv.estimator != "gae",
                "algo.distill.enabled gives per-token advantages of its own; algo.adv.estimator=gae "
                "(a critic's) does not combine with it: use grpo, dr_grpo or rloo")
