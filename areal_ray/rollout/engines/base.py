"""The inference-engine contract (`InferenceEngine`), its request/response types and the
options every engine is built from.

An engine generates for one request at a time from the caller's view (it batches
internally), returns per-token behaviour logprobs and the policy version of every
token, can be paused (aborting running requests, which come back with their partial
output, or waiting for them to finish), takes weight updates, and reports its version
and load. Backends are named in `registry.py`: `HFEngine` (transformers; the CPU
default, also runs on a GPU), `VLLMEngine` (vLLM; its CPU build too) and `SGLangEngine`
(sglang on GPUs).

The base class declares every call the rollout replica (deployments/rollout.py) makes,
so a new engine is one subclass: the abstract methods are what every engine must do;
the rest have defaults that say "this engine cannot" (no digest, no bucket streaming,
no memory release), and the replica relies on those defaults rather than probing.

When the trainer and an engine share one GPU, the engine gives its memory back while
the trainer steps (`release_memory`) and takes it again for the next rollout
(`resume_memory`). Admission stays closed in between, so no request runs on an engine
whose memory is gone; a weight update may come in between and keeps it closed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # limits.py imports this module's request type
    from areal_ray.rollout.engines.limits import RequestLimits

STOP_REASONS = ("stop", "length", "abort")

# How a pause (and so a weight update) treats requests that are running:
# "abort" ends them now with their partial output (interruptible rollout);
# "wait" lets them finish first and holds new ones back (wait-for-finish).
PAUSE_MODES = ("abort", "wait")
# An adapter push (`update_adapter`) may also "finish": running requests go on under the
# adapter they were admitted with while new ones get the new one, with no pause at
# all. Only an engine that serves several adapters side by side can (VLLMEngine);
# `rollout.lora_push` chooses (config/rollout.py).
FINISH = "finish"


@dataclass
class GenerationRequest:
    """One generation request, and its wire form: the engine client sends these to the
    replica's `generate`/`generate_batch` over the Serve handle, and the router reads
    their `max_new_tokens` (rollout/router.py). A plain dataclass: it pickles as its
    fields, and this module imports nothing heavy, so the caller stays light."""
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


@dataclass(frozen=True)
class EngineOptions:
    """What the replica knows when it builds an engine (`ServerOptions` narrowed to the
    engine's concern); each engine's `from_options` maps it onto its own constructor."""

    max_batch_size: int = 64
    dtype: str = "float32"
    batching: str = "continuous"  # HF only: continuous | static | invariant
    device: str = ""  # HF only: "" picks cuda when there is one
    threads: int = 1  # CPU threads of the engine's own process (vLLM)
    engine_kwargs: dict = field(default_factory=dict)  # rollout.engine_kwargs, verbatim
    # The engine will be asked to free its GPU memory during trainer steps: vLLM and
    # sglang must be built for that (sleep mode, memory saver).
    release_memory: bool = False
    owner: str = ""  # the job's tag: names the weight files an engine loads from
    # model.lora.rank when adapters are pushed (0: none). vLLM reserves its LoRA slots
    # at construction (`lora_slots` adapters at once); HFEngine merges any adapter into
    # its weights and needs neither.
    lora_rank: int = 0
    lora_slots: int = 2
    lora_targets: tuple[str, ...] = ()  # model.lora.target_modules (sglang reserves them)


class InferenceEngine(ABC):
    """One inference backend behind a rollout replica."""

    # The version the engine's tokens are tagged with; the replica relabels it when a
    # publication carries no new weights (the model on disk is version 0).
    version: int
    limits: RequestLimits  # what a request may ask of this model (checked before batching)
    # Whether `update_weights_from_buckets` streams a broadcast into the engine without
    # holding a whole received copy of the model.
    streams_buckets: bool = False
    # Whether the engine loads weights from host memory anyway (vLLM stages a file): the
    # replica then receives a broadcast into host memory bucket by bucket rather than
    # holding a whole model on its GPU (`WeightReceiver(host=...)`).
    loads_from_host: bool = False
    # The load probe's ids (weights/probe.py), set by the replica when the run probes:
    # an engine whose `score` would queue behind the requests a push resubmits scores
    # them inside each swap instead, while nothing else runs (VLLMEngine).
    probe_ids: list[int] | None = None

    @classmethod
    @abstractmethod
    def from_options(cls, model_path: str, opts: EngineOptions) -> InferenceEngine:
        """Build the engine for `model_path` (the replica calls this through the registry)."""

    @abstractmethod
    async def generate(self, req: GenerationRequest) -> GenerationResult: ...

    @abstractmethod
    async def pause(self, mode: str = "abort") -> None:
        """Stop admitting requests; returns once nothing runs (see PAUSE_MODES)."""

    @abstractmethod
    async def resume(self) -> None: ...

    @abstractmethod
    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        """pause(mode), load `state_dict`, serve `version` from now on, resume; returns
        what the load measured (seconds, bytes), kept in the replica's update history."""

    def get_version(self) -> int:
        return self.version

    @abstractmethod
    def load(self) -> dict:
        """At least: queued, running, outstanding_tokens (budget left of all requests)."""

    async def warmup(self) -> None:
        """Whatever must run once before the first request (compile, first forward)."""

    async def update_weights_from_buckets(self, buckets, version: int, mode: str = "abort") -> dict:
        """As `update_weights`, from an async iterator of flat buckets (`streams_buckets`)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream weight buckets")

    async def update_adapter(self, adapter, version: int, mode: str = "abort") -> dict:
        """As `update_weights`, for a LoRA adapter (`weights.adapter.Adapter`, `model.lora`):
        the adapted modules' weights become base + (B @ A) * scaling, always from the base
        weights the engine loaded, never on top of the previous adapter. `mode` is a
        pause mode, or `FINISH` where the engine serves several adapters at once."""
        raise NotImplementedError(f"{type(self).__name__} cannot apply a LoRA adapter")

    async def score(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1 under the weights served now, at temperature
        1: the load probe (weights/probe.py) after every push."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a probe")

    async def release_memory(self) -> None:
        """pause("abort"), keep admission closed, free the engine's GPU memory (KV cache,
        and what else the backend can give back) for another user of the GPU."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    async def resume_memory(self) -> None:
        """Restore what `release_memory` freed, then reopen admission."""
        raise NotImplementedError(f"{type(self).__name__} cannot release its memory")

    async def weights_digest(self) -> dict:
        """`digest`: the sha256 of the served weights in checkpoint names (what the
        engine can read back of them; see each engine)."""
        raise NotImplementedError(f"{type(self).__name__} cannot report a digest")

    def load_failure(self) -> str | None:
        """Why the last weight load failed (admission stays closed until a good one)."""
        return None

    async def check_health(self) -> None:
        """Raise when the engine can no longer serve (e.g. its own process died)."""

    def shutdown(self) -> None:
        """Stop what the engine started (threads, processes) now, not at interpreter exit."""
