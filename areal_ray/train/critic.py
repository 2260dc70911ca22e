"""The critic of PPO with GAE (`algo.adv.estimator=gae`).

The critic is the policy's architecture with a one-output token head
(`AutoModelForTokenClassification`, num_labels=1), initialised from the same
weights, so it starts with the policy's features. Its head is zeroed: the first
values are 0, and GAE with gamma = lambda = 1 then starts out as plain REINFORCE
with the outcome reward, instead of as noise from a random head.

Values are aligned like logprobs: position i holds V of the state before output
token i+1 is generated, so the loss mask, targets and values line up one to one.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForTokenClassification

from areal_ray.algo.gae import gae, token_rewards
from areal_ray.train.fsdp import load_sharded_model


def load_critic(path: str, dtype: str = "float32", attn_implementation: str = "",
                device: torch.device | str = "cpu", master_dtype: str = ""):
    def build(p, **kw):
        model = AutoModelForTokenClassification.from_pretrained(p, num_labels=1, **kw)
        torch.nn.init.zeros_(model.score.weight)
        if getattr(model.score, "bias", None) is not None:
            torch.nn.init.zeros_(model.score.bias)
        return model
    return load_sharded_model(path, dtype, build=build, attn_implementation=attn_implementation,
                              device=device, master_dtype=master_dtype)


def forward_values(critic, mb: dict) -> torch.Tensor:
    """Values shaped like mb["loss_mask"] (packed [T-1] or padded [n, W-1])."""
    if "position_ids" in mb:
        kwargs = {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"]}
        if "attention_mask" in mb:
            kwargs["attention_mask"] = mb["attention_mask"]
        return critic(**kwargs).logits[0, :-1, 0].float()
    return critic(input_ids=mb["input_ids"],
                  attention_mask=mb["attention_mask"]).logits[:, :-1, 0].float()


@torch.no_grad()
def write_gae_targets(critic, mb: dict, gamma: float, lam: float) -> None:
    """Replace the micro-batch's advantages (which hold each sequence's outcome reward
    on all its tokens) with per-token GAE advantages; add "returns" and "old_values"."""
    values = forward_values(critic, mb)
    adv = mb["advantages"].clone()
    returns = torch.zeros_like(adv)
    mask = mb["loss_mask"]
    for j in mb["seq_ids"][mask].unique().tolist():
        idx = (mb["seq_ids"] == j) & mask
        outcome = float(mb["advantages"][idx][-1])
        # gae() returns tensors on the rewards' device: that must be the values' one.
        a, r = gae(token_rewards(outcome, int(idx.sum())).to(values.device), values[idx], gamma, lam)
        adv[idx], returns[idx] = a, r
    mb["advantages"], mb["returns"], mb["old_values"] = adv, returns, values
