"""LoRA on the trainer (`model.lora`): peft's adapter injected into the policy before
FSDP2 shards it, its tensors gathered for pushes, and the exports.

`apply_lora` uses peft's `inject_adapter_in_model`, which changes the model in place
and returns the same class (not a `PeftModel` wrapper), so everything downstream (the
decoder layers FSDP shards, `model.config`, the forward) is unchanged. peft freezes
every base parameter, so the optimizer is built on the adapter's parameters only
(`trainable_parameters`) and holds state for nothing else.

Names. Under peft, module `model.layers.0.self_attn.q_proj` holds
`base_layer.weight` and `lora_A.default.weight` / `lora_B.default.weight`. Pushes and
exports name them as the plain model does: `<module>.lora_A`, `<module>.lora_B`
(weights/adapter.py) and `<module>.weight` for a base weight.

`final_model/` (and a checkpoint's `model/` with `train.checkpoint_hf_model`) holds the
merged model, plain HF, and `adapter/` beside it in peft's `save_pretrained` format
(`save_lora_model`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from areal_ray.weights.adapter import A, Adapter, B, base_digest, merged_state, peft_tensors
from areal_ray.weights.payloads import AdapterMeta

ADAPTER_DIR = "adapter"  # the peft adapter's folder inside an exported model
_PEFT_A, _PEFT_B, _PEFT_BASE = f".{A}.default.weight", f".{B}.default.weight", ".base_layer.weight"


def linear_names(model) -> list[str]:
    """The names peft can target: the last part of every nn.Linear module's name, but not
    an output projection tied to the input embeddings (merging into it would change the
    embeddings as well)."""
    tied = model.get_output_embeddings() if getattr(model.config, "tie_word_embeddings", False) \
        else None
    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                   if isinstance(mod, torch.nn.Linear) and mod is not tied})


def check_targets(model, targets: list[str]) -> None:
    """Every `model.lora.target_modules` name is a linear module of `model`."""
    available = linear_names(model)
    missing = [t for t in targets if t not in available]
    if missing:
        raise ValueError(f"model.lora.target_modules: {', '.join(missing)} "
                         f"{'is not a linear module' if len(missing) == 1 else 'are not linear modules'} "
                         f"of {type(model).__name__}; its linear modules are: {', '.join(available)}")


def check_model_targets(model_path: str, targets: list[str]) -> None:
    """`check_targets` on the model's config alone (built on the meta device: no weights
    read, no memory), before Ray starts."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    check_targets(model, targets)


def peft_config(rank: int, alpha: float, targets, dropout: float = 0.0):
    """peft's `LoraConfig` (of `model.lora`, or of a pushed adapter's meta)."""
    import peft
    return peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                           target_modules=list(targets), task_type="CAUSAL_LM")


def apply_lora(model, lora):
    """Inject `model.lora`'s adapter into `model` in place (before sharding); only the
    adapter's parameters require grad afterwards."""
    import peft
    check_targets(model, list(lora.target_modules))
    model = peft.inject_adapter_in_model(
        peft_config(lora.rank, lora.alpha, lora.target_modules, lora.dropout), model)
    for name, p in model.named_parameters():
        p.requires_grad_(A in name or B in name)
    return model


def has_lora(model) -> bool:
    return any(name.endswith(_PEFT_A) for name, _ in model.named_parameters())


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter without LoRA, the adapter's with it."""
    return [p for p in model.parameters() if p.requires_grad]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from an FSDP2 shard (a collective on every rank), a CPU copy: on one
    rank `full_tensor()` may be the parameter's own storage, which the next optimizer
    step would change under a push or a checkpoint still holding it."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """`<module>.lora_A` / `<module>.lora_B` per adapted module, whole, on the CPU. Every
    trainer rank calls it (each gather is a collective); all get the tensors."""
    out = {}
    for name, p in model.named_parameters():
        for suffix, half in ((_PEFT_A, A), (_PEFT_B, B)):
            if name.endswith(suffix):
                out[f"{name[:-len(suffix)]}.{half}"] = _full(p)
    return out


def base_weights(model) -> dict[str, torch.Tensor]:
    """module name -> base weight of every adapted module, whole (every rank)."""
    return {name[:-len(_PEFT_BASE)]: _full(p) for name, p in model.named_parameters()
            if name.endswith(_PEFT_BASE)}


def adapter_meta(model, lora, base: str, dtype: str) -> AdapterMeta:
    """The meta of every push of this run: `base` is the model's id (its path), the
    digest is of the adapted modules' base weights in `dtype` (model.dtype: what the
    replicas hold). Every rank calls it (it gathers)."""
    return AdapterMeta.from_config(lora, base, base_digest(base_weights(model), dtype))


def save_lora_model(adapter: Adapter, model_src: str, out: Path) -> Path:
    """The merged model (base at `model_src` + `adapter`, weights/adapter.py's merge: the
    weights the replicas served) as plain HF files in `out`, and the adapter alone in
    peft's format in `out/adapter` (`PeftModel.from_pretrained(base, out/"adapter")`)."""
    import peft
    from transformers import AutoModelForCausalLM

    from areal_ray.train.checkpoint import save_hf
    base = AutoModelForCausalLM.from_pretrained(model_src, dtype="auto")
    save_hf(merged_state(base.state_dict(), adapter), model_src, out)
    meta = adapter.meta
    wrapped = peft.get_peft_model(base, peft_config(meta.rank, meta.alpha, meta.targets))
    peft.set_peft_model_state_dict(wrapped, peft_tensors(adapter))
    wrapped.peft_config["default"].base_model_name_or_path = meta.base
    wrapped.save_pretrained(str(out / ADAPTER_DIR))
    return out
