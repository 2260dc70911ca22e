"""The inference-engine protocol and its request/response types.

An engine generates for one request at a time from the caller's view (it batches
internally), returns per-token behaviour logprobs and the policy version of every
token, can be paused (aborting running requests, which come back with their partial
output, or waiting for them to finish), takes weight updates, and reports its version
and load. Backends: `HFEngine` (transformers; the CPU default, also runs on a GPU),
`VLLMEngine` (vLLM; its CPU build too) and `SGLangEngine` (sglang on GPUs).

When the trainer and an engine share one GPU, the engine gives its memory back while
the trainer steps (`release_memory`) and takes it again for the next rollout
(`resume_memory`). Admission stays closed in between, so no request runs on an engine
whose memory is gone; a weight update may come in between and keeps it closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

STOP_REASONS = ("stop", "length", "abort")

# How a pause (and so a weight update) treats requests that are running:
# "abort" ends them now with their partial output (interruptible rollout);
# "wait" lets them finish first and holds new ones back (wait-for-finish).
PAUSE_MODES = ("abort", "wait")


@dataclass
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    rid: str = ""
    ignore_eos: bool = False  # generate the whole budget (benchmarks, tests)
    # Tokens that end the request like EOS does, kept in the output (stop reason
    # "stop"): a multi-turn workflow stops at the end of a tool call to run the tool.
    stop_ids: list[int] = field(default_factory=list)
    # Seed of this request's sampling (None: the engine's own generator). A client
    # that derives it from what the request is (run seed, prompt position, sample
    # index, resubmission) gets the same tokens in every run (docs/reproducibility.md).
    seed: int | None = None


@dataclass
class GenerationResult:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str  # one of STOP_REASONS
    rid: str = ""
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The wire form the rollout service returns to clients."""
        return {"output_ids": self.output_ids, "logprobs": self.logprobs,
                "versions": self.versions, "stop_reason": self.stop_reason}


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
    return mode


@runtime_checkable
class InferenceEngine(Protocol):
    async def generate(self, req: GenerationRequest) -> GenerationResult: ...

    async def pause(self, mode: str = "abort") -> None:
        """Stop admitting requests; returns once nothing runs (see PAUSE_MODES)."""

    async def resume(self) -> None: ...

    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        """pause(mode), load `state_dict`, serve `version` from now on, resume."""

    async def release_memory(self) -> None:
        """pause("abort"), keep admission closed, free the engine's GPU memory (KV cache,
        and what else the backend can give back) for another user of the GPU."""

    async def resume_memory(self) -> None:
        """Restore what `release_memory` freed, then reopen admission."""

    def get_version(self) -> int: ...

    def load(self) -> dict:
        """At least: queued, running, outstanding_tokens (budget left of all requests)."""
