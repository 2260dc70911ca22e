"""PPO's clipped value (critic) loss.

The critic regresses its per-token value V onto the GAE returns R. As in the policy
loss, one batch is used for several updates, so the new value is kept near the value
at collection time: the loss takes the worse (larger) of the plain squared error and
the error of a value clipped to old +- value_clip, so a step never gains by moving V
further than the clip range.

    L = 0.5 * max((v - R)^2, (old + clamp(v - old, -c, c) - R)^2)

Like the policy loss it is a token sum over the mask divided by `normalizer` (the
step's global token count when micro-batched), so micro-batch losses add up to the
batch mean.
"""

from __future__ import annotations

import torch

from areal_ray.algo.loss import masked_mean


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, value_clip: float | None = 0.2,
               normalizer: float | torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss and detached scalar stats; `value_clip=None` disables the
    clip (plain 0.5 * squared error)."""
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"value_loss: shapes differ: values {tuple(values.shape)}, old_values "
            f"{tuple(old_values.shape)}, returns {tuple(returns.shape)}, mask {tuple(mask.shape)}")
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
    mask = mask.bool()
    n_tokens = mask.float().sum()
    denom = n_tokens.clamp(min=1.0) if normalizer is None else torch.as_tensor(
        normalizer, dtype=torch.float32, device=values.device).clamp(min=1.0)
    # Masked positions zeroed first: padding never brings inf/NaN into gradients.
    v = torch.where(mask, values.float(), 0.0)
    old = torch.where(mask, old_values.float(), 0.0)
    ret = torch.where(mask, returns.float(), 0.0)

    err = (v - ret).square()
    if value_clip is None:
        per_token, clip_hit = 0.5 * err, torch.zeros_like(mask)
    else:
        clipped_v = old + torch.clamp(v - old, -value_clip, value_clip)
        clipped_err = (clipped_v - ret).square()
        per_token = 0.5 * torch.maximum(err, clipped_err)
        clip_hit = (clipped_err > err) & mask
    loss = torch.where(mask, per_token, 0.0).sum() / denom

    with torch.no_grad():
        stats = {
            "value_clip_frac": masked_mean(clip_hit.float(), mask),
            "value_mean": masked_mean(v, mask),
            "return_mean": masked_mean(ret, mask),
            "explained_variance": explained_variance(v, ret, mask),
        }
    return loss, stats


def explained_variance(pred: torch.Tensor, target: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(target - pred) / Var(target) over the mask: 1 is a perfect critic, 0 no
    better than a constant. 0 when the targets do not vary (the ratio is undefined)."""
    mask = mask.bool()
    t, p = target[mask].float(), pred[mask].float()
    if t.numel() < 2:
        return torch.zeros(())
    var_t = t.var(unbiased=False)
    if var_t <= 0:
        return torch.zeros(())
    return (1.0 - (t - p).var(unbiased=False) / var_t).detach()
