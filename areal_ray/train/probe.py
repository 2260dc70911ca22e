"""The trainer's side of the load probe (weights/probe.py): the log-probabilities of the
fixed probe sequence under the weights being pushed.

Every trainer rank runs it (the FSDP2 forward gathers each layer's shards), in eval
mode so that LoRA dropout draws nothing, and back in train mode after. The forward is
the trainer's own `token_logprobs`, the function its proximal logprobs come from.
"""

from __future__ import annotations

import torch

from areal_ray.algo.logprobs import token_logprobs
from areal_ray.weights.probe import probe_ids


def model_probe(model) -> tuple[list[int], list[float]]:
    """(probe ids, log p(ids[i] | ids[:i]) for i >= 1) of `model` now."""
    ids = probe_ids(model.config.vocab_size)
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lps = token_logprobs(model, x, torch.ones_like(x), 1.0)
    finally:
        model.train(was_training)
    return ids, lps[0].float().tolist()
