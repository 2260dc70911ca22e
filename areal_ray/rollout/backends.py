"""Which inference engine a rollout replica runs (`rollout.backend`).

The HF engine is built here directly; the vLLM and sglang ones are imported only when
asked for, so a machine needs only the engine it runs.
"""

from __future__ import annotations

from areal_ray.config.choices import RolloutBackend
from areal_ray.rollout.engine import InferenceEngine


# The engine argument that makes its GPU memory releasable.
RELEASE_ARGS = {"vllm": "enable_sleep_mode", "sglang": "enable_memory_saver"}


def build_engine(backend: str, model_path: str, *, max_batch_size: int = 64,
                 dtype: str = "float32", batching: str = "continuous", device: str = "",
                 threads: int = 1, engine_kwargs: dict | None = None,
                 release_memory: bool = False, owner: str = "") -> InferenceEngine:
    """`release_memory`: the engine will be asked to free its GPU memory during trainer
    steps (`release_memory()` / `resume_memory()`); vLLM and sglang must be built for it
    (vLLM's sleep mode, sglang's memory saver). `owner`: the job's tag, which names the
    weight files vLLM loads from (areal_ray/cluster/ownership.py)."""
    kwargs = dict(engine_kwargs or {})
    if release_memory and backend in RELEASE_ARGS:
        kwargs.setdefault(RELEASE_ARGS[backend], True)
    if backend == "hf":
        import torch

        from areal_ray.rollout.hf_engine import HFEngine
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return HFEngine(model_path, max_batch_size=max_batch_size, device=device, dtype=dtype,
                        batching=batching, **kwargs)
    if backend == "vllm":
        from areal_ray.rollout.vllm_engine import VLLMEngine
        return VLLMEngine(model_path, max_batch_size=max_batch_size, dtype=dtype,
                          threads=threads, owner=owner, **kwargs)
    if backend == "sglang":
        from areal_ray.rollout.sglang_engine import SGLangEngine
        return SGLangEngine(model_path, dtype=dtype, **kwargs)
    raise ValueError(f"rollout backend {backend!r} is not one of {RolloutBackend.values()}")
