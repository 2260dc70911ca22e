"""`model.*`: the HF model that is trained and served, and `model.lora`, the low-rank
adapter trained in its place when enabled.

Whether `attn_implementation` fits the hardware is a cross-section check (root.py), and
so is which weight paths and engines can carry an adapter. Whether the target modules
exist is checked when the model is built (`areal_ray/train/lora.py: check_targets`),
and before Ray starts, on the model's config alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.section import opt, require, section

# Every linear projection of a Llama/Qwen-style decoder layer: attention and MLP.
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(kw_only=True)
class LoraConfig:
    enabled: bool = opt(False, "train a LoRA adapter (peft) instead of every weight; the base model stays frozen, pushes carry only the adapter")
    rank: int = opt(8, "LoRA rank r of every adapted module")
    alpha: float = opt(16.0, "LoRA alpha: the update is scaled by alpha / rank")
    dropout: float = opt(0.0, "dropout on the adapter's input while training (0: the trainer's logprobs are deterministic)")
    target_modules: list[str] = opt(DEFAULT_LORA_TARGETS, "names of the nn.Linear modules that get an adapter (the last part of their module name, as peft matches them)")

    def check(self) -> None:
        require(self.rank >= 1, f"model.lora.rank must be >= 1 (got {self.rank})")
        require(self.alpha > 0, f"model.lora.alpha must be > 0 (got {self.alpha:g})")
        require(0 <= self.dropout < 1, f"model.lora.dropout must be in [0, 1) (got {self.dropout:g})")
        require(bool(self.target_modules), "model.lora.target_modules must name at least one module")

    @property
    def scaling(self) -> float:
        """peft's scaling of the update B @ A (without rsLoRA)."""
        return self.alpha / self.rank


@dataclass(kw_only=True)
class ModelConfig:
    path: str = opt("artifacts/tiny", "HF model directory (config, weights, tokenizer) to train")
    dtype: str = opt("float32", "parameter dtype for training and rollout")
    attn_implementation: str = opt("", "trainer attention kernel, e.g. flash_attention_2 on GPUs (packed micro-batches then use varlen kernels); empty: transformers' default")
    lora: LoraConfig = section(LoraConfig, "a LoRA adapter trained on the frozen model (peft)")
