"""The decoupled PPO objective (AReaL paper, eq. 5; shared/DESIGN.md invariant 3).

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
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over `mask`; 0 where the mask is empty (no NaN from 0/0)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level decoupled PPO loss.

    All tensors share one shape (e.g. [batch, seq] or a packed [tokens]); `advantages`
    are per token. `loss_mask` marks the generated tokens that count.

    `normalizer`: the denominator of the token mean. None means this call's own
    masked token count. A trainer that splits a step into micro-batches (and ranks)
    passes the step's global masked-token count, so that summing the micro-batch
    losses gives one token mean over the whole batch.

    Returns (loss, stats); stats are detached scalars.
    """
    if not (logprobs.shape == proximal_logprobs.shape == behavior_logprobs.shape
            == advantages.shape == loss_mask.shape):
        raise ValueError(
            "decoupled_ppo_loss: shapes differ: "
            f"logprobs {tuple(logprobs.shape)}, proximal {tuple(proximal_logprobs.shape)}, "
            f"behavior {tuple(behavior_logprobs.shape)}, advantages {tuple(advantages.shape)}, "
            f"loss_mask {tuple(loss_mask.shape)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    mask = loss_mask.bool()
    fmask = mask.to(logprobs.dtype)
    n_tokens = fmask.sum()
    denom = n_tokens.clamp(min=1.0) if normalizer is None else torch.as_tensor(
        normalizer, dtype=logprobs.dtype, device=logprobs.device).clamp(min=1.0)

    # Ratios are computed in fp32 with masked positions zeroed, so padding never
    # produces inf/NaN that could leak into gradients.
    log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float(), 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    adv = advantages.float()
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    if dual_clip is not None:
        pg = torch.minimum(pg, dual_clip * adv.abs())

    behav_log_w = torch.where(mask, proximal_logprobs.float() - behavior_logprobs.float(), 0.0)
    behav_w = torch.exp(behav_log_w).detach()
    keep = mask
    if behav_imp_weight_cap is not None:
        keep = mask & (behav_w <= behav_imp_weight_cap)
    pg = pg * behav_w
    loss = torch.where(keep, pg, 0.0).sum() / denom

    with torch.no_grad():
        clip_hit = (-adv * clipped > -adv * ratio) & mask
        stats = {
            "n_tokens": n_tokens.detach(),
            "clip_frac": masked_mean(clip_hit.float(), mask),
            "behav_weight_mean": masked_mean(behav_w, mask),
            "behav_weight_max": torch.where(mask, behav_w, 0.0).max()
            if mask.any() else torch.zeros(()),
            "capped_frac": masked_mean((mask & ~keep).float(), mask),
            # k3 estimator of KL(pi_prox || pi_theta): non-negative, low variance.
            "approx_kl": masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats
