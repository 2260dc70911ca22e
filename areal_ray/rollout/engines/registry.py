"""Which inference engine a rollout replica runs (`rollout.backend`): the one table of
engines.

Entries are "module:Class" strings, imported only when a replica asks for that backend,
so a machine needs only the engine it runs, and the config can list the choices
(`config/choices.py`) without importing torch or any engine. Adding an engine is one
`InferenceEngine` subclass and one line here (docs/extending.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_ray.rollout.engines.base import EngineOptions, InferenceEngine

ENGINES: dict[str, str] = {
    "hf": "areal_ray.rollout.engines.hf:HFEngine",
    "vllm": "areal_ray.rollout.engines.vllm:VLLMEngine",
    "sglang": "areal_ray.rollout.engines.sglang:SGLangEngine",
}


def engine_class(backend: str) -> type[InferenceEngine]:
    from areal_ray.plugins import import_entry  # not at the top: the config imports this module
    from areal_ray.rollout.engines.base import InferenceEngine

    if backend not in ENGINES:
        raise ValueError(f"rollout backend {backend!r} is not one of {tuple(ENGINES)}")
    cls = import_entry(ENGINES[backend])
    if not (isinstance(cls, type) and issubclass(cls, InferenceEngine)):
        raise TypeError(f"{ENGINES[backend]} (rollout backend {backend!r}) is not an InferenceEngine")
    return cls


def build_engine(backend: str, model_path: str, opts: EngineOptions | None = None) -> InferenceEngine:
    from areal_ray.rollout.engines.base import EngineOptions

    return engine_class(backend).from_options(model_path, opts or EngineOptions())
