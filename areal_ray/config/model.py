"""`model.*`: the HF model that is trained and served.

Whether `attn_implementation` fits the hardware is a cross-section check (root.py):
flash kernels need `train.use_gpu`.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.section import opt


@dataclass(kw_only=True)
class ModelConfig:
    path: str = opt("artifacts/tiny", "HF model directory (config, weights, tokenizer) to train")
    dtype: str = opt("float32", "parameter dtype for training and rollout")
    attn_implementation: str = opt("", "trainer attention kernel, e.g. flash_attention_2 on GPUs (packed micro-batches then use varlen kernels); empty: transformers' default")
