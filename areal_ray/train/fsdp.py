"""The trainer's model: an HF causal LM sharded with FSDP2 (`fully_shard`).

Each decoder layer is its own FSDP unit, then the whole model, so parameters are
gathered one layer at a time. On CPU the process group is gloo (Ray Train sets it
up); the same code runs with NCCL on GPUs. `full_state_dict` must be called on every
rank (it all-gathers); only rank 0 gets the tensors, as plain CPU tensors ready to
push to rollout replicas or save in HF format.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard")
    return list(layers)


def load_sharded_model(path: str, dtype: str = "float32", build=None, trainable: bool = True,
                       attn_implementation: str = ""):
    """`build(path, dtype=..., [attn_implementation=...])` makes the unsharded model
    (default: the causal LM); `trainable=False` freezes it (the KL reference model)."""
    build = build or AutoModelForCausalLM.from_pretrained
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = build(path, dtype=getattr(torch, dtype), **kwargs)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if dist.is_available() and dist.is_initialized():
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    if dist.is_available() and dist.is_initialized():
        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
