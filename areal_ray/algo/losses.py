"""Which policy loss a training step minimises (`algo.loss.name`): the one table of losses.

Entries are "module:function" strings, imported only when a trainer worker resolves
them (`policy_loss`), so the config can list the choices (`config/choices.py`) without
importing torch: this module imports nothing heavy. Adding a loss is one function and
one line here (docs/extending.md).

Every loss has one signature:

    def my_loss(x: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]

`x` holds one micro-batch's tensors (all of one shape: a packed [tokens] row or padded
[rows, seq]); `cfg` is `algo.loss` (the clips, the cap, the importance level, the KL
settings, `correction`: the mismatch correction a loss applies to its behaviour weight,
as `algo/loss.py`'s `behaviour_weight` does; the config refuses a correction with a loss not
in `config.algo.CORRECTION_LOSSES`). It returns the scalar loss, already divided by
`x.normalizer` (the minibatch's global masked-token count, so that summing the
micro-batches' losses gives one token mean over the whole batch on every rank), and
detached scalar stats. `train_step` records the stats of `train.step.POLICY_STATS`
plus `behav_weight_max`, weighted by `n_tokens` (the masked token count: `loss_mask`'s
sum when absent); a stat a loss does not report is recorded as NaN, "not measured".
The step itself adds the entropy bonus and measures entropy and the engine/trainer
mismatch, whatever the loss. The loss's own job is the objective: micro-batching, the proximal policy, the
reference model, the non-finite guard and the optimizer step stay `train_step`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from areal_ray.config.algo import LossConfig

DEFAULT = "decoupled_ppo"

LOSSES: dict[str, str] = {
    "decoupled_ppo": "areal_ray.algo.loss:ppo_policy_loss",
    "cispo": "areal_ray.algo.loss:cispo_loss",
}


@dataclass
class LossInputs:
    """One micro-batch as a policy loss sees it."""

    logprobs: torch.Tensor  # log pi_theta of each token, with gradients
    proximal_logprobs: torch.Tensor  # pi_prox (decoupled PPO's anchor; behaviour's with decoupled=false)
    behavior_logprobs: torch.Tensor  # what the engine sampled with
    advantages: torch.Tensor  # per token
    loss_mask: torch.Tensor  # 1 on the tokens that train (the model's own)
    normalizer: float  # the minibatch's global masked-token count: divide the sum by it
    seq_ids: torch.Tensor | None = None  # which sequence each token is of (GSPO)
    ref_logprobs: torch.Tensor | None = None  # log pi_ref, with algo.loss.kl_coef > 0
    batch: dict = field(default_factory=dict)  # the whole micro-batch (versions, ids, ...)


PolicyLossFn = Callable[["LossInputs", "LossConfig"], "tuple[torch.Tensor, dict]"]


def policy_loss(name: str) -> PolicyLossFn:
    """The loss function registered as `name`; ValueError naming the choices if none is."""
    if name not in LOSSES:
        raise ValueError(f"algo.loss.name {name!r} is not one of {tuple(LOSSES)}")
    from areal_ray.plugins import import_entry  # not at the top: the config imports this module

    fn = import_entry(LOSSES[name])
    if not callable(fn):
        raise TypeError(f"{LOSSES[name]} (algo.loss.name {name!r}) is not a function")
    return fn
