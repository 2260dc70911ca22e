"""A LoRA adapter as pushes carry it, and the one merge every side computes.

An adapter is `<module>.lora_A` (rank x in) and `<module>.lora_B` (out x rank) per
adapted linear module, named by the module's name in the plain model (no peft
prefixes), with its `AdapterMeta`. The merged weight of a module is

    W = W_base + (B @ A) * scaling

computed in float32 and cast back to W_base's dtype. The order of operations is
peft's own (`Linear.get_delta_weight`, then `weight += delta`), so on float32 models
the engine's weights, the trainer's merged export and peft's `merge_and_unload` are
bit-identical (tests/weights/test_adapter.py). In float32 the cast is a no-op; in
bf16 peft adds the rounded delta to the bf16 weight, where this adds in float32 and
rounds once, so there the two may differ by one bf16 rounding step.

Every merge starts from the base weights (`merged_state`, `HFEngine.update_adapter`):
applying version v+1 never stacks on version v.

Needs torch only; peft is the trainer's (areal_ray/train/lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_ray.weights.payloads import AdapterMeta

A, B = "lora_A", "lora_B"


@dataclass
class Adapter:
    """A received adapter: the tensors (possibly views of a push's memory) and meta."""
    meta: AdapterMeta
    tensors: dict[str, torch.Tensor]

    @property
    def modules(self) -> list[str]:
        """The adapted modules' names, in push order."""
        return list(dict.fromkeys(k.rsplit(".", 1)[0] for k in self.tensors))

    def pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[f"{module}.{A}"], self.tensors[f"{module}.{B}"]

    def check(self) -> None:
        """Every module has both halves of a rank-`meta.rank` update."""
        for k in self.tensors:
            if k.rsplit(".", 1)[-1] not in (A, B):
                raise ValueError(f"adapter tensor {k!r} is neither {A} nor {B}")
        for m in self.modules:
            if f"{m}.{A}" not in self.tensors or f"{m}.{B}" not in self.tensors:
                raise ValueError(f"adapter of {m} lacks {A} or {B}")
            a, b = self.pair(m)
            if a.shape[0] != self.meta.rank or b.shape[1] != self.meta.rank:
                raise ValueError(f"adapter of {m}: A {tuple(a.shape)}, B {tuple(b.shape)} "
                                 f"are not of rank {self.meta.rank}")


def peft_tensors(adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (`save_pretrained`'s
    `adapter_model.safetensors`, which `set_peft_model_state_dict` and vLLM read)."""
    return {f"base_model.model.{k}.weight": v for k, v in adapter.tensors.items()}


def merge_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W_base + (B @ A) * scaling, in float32, in W_base's dtype (peft's order)."""
    delta = (b.to(device=base.device, dtype=torch.float32)
             @ a.to(device=base.device, dtype=torch.float32)) * scaling
    return (base.float() + delta).to(base.dtype)


def merged_state(base: dict[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """`base` (a plain model's state dict) with every adapted module's weight merged; the
    other tensors are `base`'s own."""
    out = dict(base)
    for m in adapter.modules:
        key = f"{m}.weight"
        if key not in base:
            raise ValueError(f"the adapter adapts {m}, which the base model does not have")
        out[key] = merge_weight(base[key], *adapter.pair(m), adapter.meta.scaling)
    return out


def base_digest(weights: dict[str, torch.Tensor], dtype: str) -> str:
    """The sha256 of the adapted modules' base weights (module name -> weight) in `dtype`:
    what a replica checks before it applies an adapter (`AdapterMeta.base_digest`)."""
    from areal_ray.weights.encoding import digest
    to = getattr(torch, dtype)
    return digest({m: w.to(to) for m, w in weights.items()})
