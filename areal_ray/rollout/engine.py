"""The inference-engine protocol and its request/response types.

An engine generates for one request at a time from the caller's view (it may batch
internally), returns per-token behaviour logprobs and the policy version of every
token, can be interrupted by a weight update, and reports its version and load.
Backends: `HFEngine` (transformers; the CPU default) and, on GPUs, `SGLangEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

STOP_REASONS = ("stop", "length", "abort")


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    rid: str = ""
    ignore_eos: bool = False  # generate the whole budget (benchmarks, tests)


@dataclass
class GenerationResult:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str  # one of STOP_REASONS
    rid: str = ""
    meta: dict = field(default_factory=dict)


@runtime_checkable
class InferenceEngine(Protocol):
    async def generate(self, req: GenerationRequest) -> GenerationResult: ...

    async def update_weights(self, state_dict: dict, version: int) -> dict: ...

    def get_version(self) -> int: ...

    def load(self) -> dict: ...
