"""The trainer's model: an HF causal LM sharded with FSDP2 (`fully_shard`).

Each decoder layer is its own FSDP unit, then the whole model, so parameters are
gathered one layer at a time. On CPU the process group is gloo (Ray Train sets it
up); with `train.use_gpu` it is NCCL and the model is moved to the worker's GPU
before sharding, so the shards and FSDP's mesh live there. Everything downstream
finds the device from the parameters (`model_device`). `full_state_dict` must be
called on every rank (it all-gathers); only rank 0 gets the tensors, as plain CPU
tensors ready to push to rollout replicas or save in HF format.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM


def decoder_layers(model) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard")
    return list(layers)


def load_sharded_model(path: str, dtype: str = "float32", build=None, trainable: bool = True,
                       attn_implementation: str = "", device: torch.device | str = "cpu",
                       master_dtype: str = "", activation_checkpointing: bool = False,
                       lora=None):
    """`build(path, dtype=..., [attn_implementation=...])` makes the unsharded model
    (default: the causal LM); `trainable=False` freezes it (the KL reference model).
    `master_dtype` (e.g. float32 under a bfloat16 `dtype`) is the dtype the parameters
    and the optimizer state are kept in, while sharded forward/backward run in `dtype`:
    in bf16 alone, an AdamW update (about lr, ~1e-5) is below half the rounding step
    of a typical weight (~6e-5 at 0.03) and would mostly be lost.

    `activation_checkpointing` uses transformers' own (each decoder layer is a
    GradientCheckpointingLayer, recomputed in the backward, non-reentrant so it composes
    with FSDP2's hooks); it applies in train mode only, so no-grad passes are unchanged.

    `lora` (`model.lora`, when enabled) injects peft's adapter before sharding, so the
    adapter's parameters are sharded with their decoder layer and are the only ones
    that require grad (areal_ray/train/lora.py)."""
    build = build or AutoModelForCausalLM.from_pretrained
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    device = torch.device(device)
    model = build(path, dtype=getattr(torch, master_dtype or dtype), **kwargs)
    if lora is not None and lora.enabled and trainable:
        from areal_ray.train.lora import apply_lora
        model = apply_lora(model, lora)
    sharded = dist.is_available() and dist.is_initialized()
    if not (sharded and device.type == "cuda"):
        model = model.to(device)
    # else fully_shard moves each unit's parameters to the mesh's GPU as it shards them:
    # one unit is whole on the GPU at a time, never the whole fp32 model (GPU_AUDIT O2).
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    elif activation_checkpointing:
        enable_activation_checkpointing(model)
    if sharded:
        # An explicit mesh of the model's device type: FSDP's default follows whatever
        # accelerator is visible, which would not match a CPU trainer on a GPU node.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32) \
            if master_dtype and master_dtype != dtype else MixedPrecisionPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def enable_activation_checkpointing(model) -> None:
    """transformers' own, non-reentrant; it acts in train mode only."""
    model.config.use_cache = False  # training forwards keep no KV cache anyway
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def model_device(model) -> torch.device:
    """Where the model's parameters (FSDP shards included) live: the device its inputs
    must be on."""
    return next(model.parameters()).device


def full_state_dict(model) -> dict[str, torch.Tensor]:
    if dist.is_available() and dist.is_initialized():
        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
