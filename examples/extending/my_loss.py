"""A policy loss: `reinforce_loss`, token-level REINFORCE with the behaviour correction
truncated at `algo.loss.behav_imp_weight_cap` (no ratio clipping).

Every loss has the signature of areal_ray/algo/losses.py: `(LossInputs, algo.loss) ->
(loss, stats)`, the loss a sum over the masked tokens divided by `x.normalizer`. To use
it: one line in areal_ray/algo/losses.py's LOSSES,
    "reinforce": "examples.extending.my_loss:reinforce_loss",
then `algo.loss.name=reinforce`.
"""

from __future__ import annotations

import torch

from areal_ray.algo.losses import LossInputs


def reinforce_loss(x: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = x.loss_mask.bool()
    # Masked positions zeroed before exp: padding never yields inf or NaN.
    log_w = torch.where(mask, x.proximal_logprobs.float() - x.behavior_logprobs.float(), 0.0)
    w = torch.exp(log_w).detach()
    if cfg.behav_imp_weight_cap is not None:
        w = w.clamp(max=cfg.behav_imp_weight_cap)
    pg = torch.where(mask, -w * x.advantages.float() * x.logprobs.float(), 0.0)
    loss = pg.sum() / max(float(x.normalizer), 1.0)
    n = mask.sum().float()
    stats = {"n_tokens": n, "behav_weight_mean": (w * mask).sum().detach() / n.clamp(min=1.0)}
    return loss, stats
