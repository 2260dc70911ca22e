"""The decoupled PPO objective (AReaL paper, eq. 5; invariant 3 in docs/architecture.md).

Samples trained asynchronously were produced by a *behaviour* policy that may be
several versions old. Decoupled PPO clips the ratio around a *proximal* policy (the
trainer's weights before this update, recomputed by a forward pass) instead of
around the behaviour policy, and corrects for the behaviour mismatch with the
importance weight w = pi_prox / pi_behav. When pi_prox == pi_behav, w == 1 and this
is exactly standard PPO.

Unlike AReaL's current default, the behaviour weight is *always* applied: dropping it
silently turns the objective into something else. Tokens whose weight exceeds
`behav_imp_weight_cap` are masked out, but still counted in the denominator, so the
cap never changes the scale of the loss.

A mismatch correction (`algo.loss.correction`, algo/corrections.py) replaces the cap
by its own weight and mask of w (TIS, masked IS, IcePop); it is off by default, and
then the objective is exactly as described here. CISPO (`cispo_loss`) is the other
registered loss.

Two options change the objective, both off by default:
* `level="sequence"` (GSPO): the clipped ratio and the advantage are per sequence
  (`algo.gspo`); the behaviour weight stays per token, since staleness is per token.
* `kl_coef > 0`: a penalty towards a reference model (`algo.kl`) on every masked
  token. It is not subject to the behaviour cap: the cap guards the off-policy
  correction, while the KL term only asks pi_theta to stay near pi_ref.
"""

from __future__ import annotations

import torch

from areal_ray.algo.corrections import OFF
from areal_ray.algo.gspo import sequence_mean
from areal_ray.algo.is_correction import behaviour_correction
from areal_ray.algo.kl import KL_ESTIMATORS, kl_estimate
from areal_ray.algo.losses import LossInputs

LEVELS = ("token", "sequence")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over `mask`; 0 where the mask is empty (no NaN from 0/0)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _check_args(tensors: dict[str, torch.Tensor | None], dual_clip: float | None,
                level: str, kl_coef: float, kl_estimator: str) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError("decoupled_ppo_loss: shapes differ: "
                         + ", ".join(f"{k} {s}" for k, s in shapes.items()))
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if level not in LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; one of {LEVELS}")
    if level == "sequence" and tensors["seq_ids"] is None:
        raise ValueError("level='sequence' (GSPO) needs seq_ids")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and tensors["ref_logprobs"] is None:
        # Silently skipping the penalty would train a different objective.
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kl_estimator!r}; one of {KL_ESTIMATORS}")


def _log_ratio_and_adv(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, level: str,
                       seq_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """log(pi_theta / pi_prox) and advantages as the surrogate sees them: per token,
    or (GSPO) each token carrying its sequence's mean of both."""
    # fp32, masked positions zeroed: padding never produces inf/NaN in gradients.
    log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float(), 0.0)
    adv = torch.where(mask, advantages.float(), 0.0)
    if level == "sequence":
        return sequence_mean(log_ratio, seq_ids, mask), sequence_mean(adv, seq_ids, mask)
    return log_ratio, adv


def _kl_term(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
             mask: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Per-token KL(pi_theta || pi_ref) estimate on masked tokens (0 elsewhere)."""
    if ref_logprobs is None:
        return None
    kl = kl_estimate(torch.where(mask, logprobs.float(), 0.0),
                     torch.where(mask, ref_logprobs.float(), 0.0), kind)
    return torch.where(mask, kl, 0.0)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    normalizer: float | torch.Tensor | None = None,
    *,
    level: str = "token",
    seq_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    correction: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO loss, token- or sequence-level (GSPO), with an optional KL penalty.

    All tensors share one shape (e.g. [batch, seq] or a packed [tokens]); `advantages`
    are per token. `loss_mask` marks the generated tokens that count. `seq_ids` (the
    micro-batch target of that name) is required for `level="sequence"`;
    `ref_logprobs` for `kl_coef > 0`. `correction`: `behaviour_correction`'s keywords
    (algo/is_correction.py), which replace `behav_imp_weight_cap`; None: the cap.

    `normalizer`: the denominator of the token mean. None means this call's own
    masked token count. A trainer that splits a step into micro-batches (and ranks)
    passes the step's global masked-token count, so that summing the micro-batch
    losses gives one token mean over the whole batch. The KL term shares it.

    Returns (loss, stats); stats are detached scalars.
    """
    _check_args({"logprobs": logprobs, "proximal": proximal_logprobs,
                 "behavior": behavior_logprobs, "advantages": advantages,
                 "loss_mask": loss_mask, "seq_ids": seq_ids, "ref_logprobs": ref_logprobs},
                dual_clip, level, kl_coef, kl_estimator)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    mask = loss_mask.bool()
    n_tokens = mask.float().sum()
    denom = n_tokens.clamp(min=1.0) if normalizer is None else torch.as_tensor(
        normalizer, dtype=torch.float32, device=logprobs.device).clamp(min=1.0)

    log_ratio, adv = _log_ratio_and_adv(logprobs, proximal_logprobs, advantages, mask,
                                        level, seq_ids)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    if dual_clip is not None:
        pg = torch.minimum(pg, dual_clip * adv.abs())

    behav_w, keep, corr_stats = behaviour_weight(proximal_logprobs, behavior_logprobs, mask,
                                                 behav_imp_weight_cap, correction, seq_ids)
    loss = torch.where(keep, pg * behav_w, 0.0).sum() / denom

    kl = _kl_term(logprobs, ref_logprobs, mask, kl_estimator)
    if kl is not None and kl_coef > 0:
        loss = loss + kl_coef * kl.sum() / denom

    with torch.no_grad():
        token_log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float(), 0.0)
        stats = {
            "n_tokens": n_tokens.detach(),
            "clip_frac": masked_mean(((-adv * clipped > -adv * ratio) & mask).float(), mask),
            "behav_weight_mean": masked_mean(behav_w, mask),
            "behav_weight_max": torch.where(mask, behav_w, 0.0).max()
            if mask.any() else torch.zeros(()),
            "capped_frac": corr_stats["correction_masked_frac"],  # the same tokens
            # k3 estimator of KL(pi_prox || pi_theta): non-negative, low variance.
            "approx_kl": masked_mean(torch.exp(-token_log_ratio) - 1.0 + token_log_ratio, mask),
            "ratio_mean": masked_mean(ratio.detach(), mask),
            "kl_ref": masked_mean(kl.detach(), mask) if kl is not None else torch.zeros(()),
            **corr_stats,
        }
    return loss, stats


def behaviour_weight(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                     mask: torch.Tensor, cap: float | None, correction: dict | None,
                     seq_ids: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(w, keep, stats): the detached behaviour weight pi_prox / pi_behav per token and
    the tokens the loss keeps. Without a correction (None, or mode "off"): w with the
    upper `cap`; with one, the mode's weight and mask (algo/is_correction.py) replace
    the cap."""
    behav_log_w = torch.where(mask, proximal_logprobs.float() - behavior_logprobs.float(), 0.0)
    if correction is not None and correction.get("mode", OFF) != OFF:
        return behaviour_correction(behav_log_w, mask, seq_ids, **correction)
    behav_w = torch.exp(behav_log_w).detach()
    keep = mask
    if cap is not None:
        keep = mask & (behav_w <= cap)
    with torch.no_grad():  # the cap is the default correction: a one-sided token mask
        stats = {"correction_truncated_frac": torch.zeros(()),
                 "correction_masked_frac": masked_mean((mask & ~keep).float(), mask)}
    return behav_w, keep, stats


def correction_args(cfg) -> dict | None:
    """`algo.loss.correction` as `behaviour_correction`'s keywords; None when off."""
    c = getattr(cfg, "correction", None)
    if c is None or c.mode == OFF:
        return None
    return {"mode": str(c.mode), "is_threshold": c.is_threshold, "rs_threshold": c.rs_threshold,
            "rs_threshold_lower": c.rs_threshold_lower}


def ppo_policy_loss(x: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`decoupled_ppo_loss` as the registered default (`algo.loss.name=decoupled_ppo`,
    `algo/losses.py`): every option from `algo.loss` (`cfg`)."""
    return decoupled_ppo_loss(
        x.logprobs, x.proximal_logprobs, x.behavior_logprobs, x.advantages, x.loss_mask,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap, normalizer=x.normalizer,
        level=cfg.importance_level, seq_ids=x.seq_ids, ref_logprobs=x.ref_logprobs,
        kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator, correction=correction_args(cfg))


def cispo_loss(x: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1): REINFORCE on log pi_theta weighted by the clipped, detached
    ratio r = pi_theta / pi_prox, clip(r, 1 - cispo_eps_low, 1 + cispo_eps_high).
    Unlike PPO's clip, which zeroes the gradient of a clipped token, every token keeps
    a gradient; the clip only bounds its weight. The behaviour weight (and any
    `algo.loss.correction`) applies as in the decoupled objective; token level only."""
    _check_args({"logprobs": x.logprobs, "proximal": x.proximal_logprobs,
                 "behavior": x.behavior_logprobs, "advantages": x.advantages,
                 "loss_mask": x.loss_mask, "seq_ids": x.seq_ids, "ref_logprobs": x.ref_logprobs},
                None, "token", cfg.kl_coef, cfg.kl_estimator)
    mask = x.loss_mask.bool()
    denom = torch.as_tensor(x.normalizer, dtype=torch.float32,
                            device=x.logprobs.device).clamp(min=1.0)
    log_ratio, adv = _log_ratio_and_adv(x.logprobs, x.proximal_logprobs, x.advantages, mask,
                                        "token", None)
    ratio = torch.exp(log_ratio).detach()
    lo, hi = 1.0 - cfg.cispo_eps_low, 1.0 + cfg.cispo_eps_high
    clipped = ratio.clamp(lo, hi)
    behav_w, keep, corr_stats = behaviour_weight(x.proximal_logprobs, x.behavior_logprobs, mask,
                                                 cfg.behav_imp_weight_cap, correction_args(cfg),
                                                 x.seq_ids)
    pg = -adv * clipped * torch.where(mask, x.logprobs.float(), 0.0)
    loss = torch.where(keep, pg * behav_w, 0.0).sum() / denom
    kl = _kl_term(x.logprobs, x.ref_logprobs, mask, cfg.kl_estimator)
    if kl is not None and cfg.kl_coef > 0:
        loss = loss + cfg.kl_coef * kl.sum() / denom
    with torch.no_grad():
        stats = {
            "n_tokens": mask.float().sum(),
            "clip_frac": masked_mean(((ratio < lo) | (ratio > hi)).float(), mask),
            "behav_weight_mean": masked_mean(behav_w, mask),
            "behav_weight_max": torch.where(mask, behav_w, 0.0).max()
            if mask.any() else torch.zeros(()),
            "capped_frac": corr_stats["correction_masked_frac"],  # the same tokens
            "approx_kl": masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, mask),
            "kl_ref": masked_mean(kl, mask) if kl is not None else torch.zeros(()),
            **corr_stats,
        }
    return loss, stats
