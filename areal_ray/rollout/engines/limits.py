"""RequestLimits: what a generation request may ask of the model, checked before any
engine batches it.

Why before the engine: an engine runs many requests in one step. A token id outside
the vocabulary indexes past the embedding table, a prompt past the context past the
position table or the KV cache, a seed past int64 overflows the sampler's generator,
and the error is raised inside a step shared with other requests: HFEngine's batched
forward, vLLM's engine core (which dies of it, with every request in it and after it:
measured on its CPU build) or sglang's scheduler (on CUDA a device-side assert).
Neither backend checks all of it for us: vLLM checks ids only with its tokenizer
loaded, and we send ids with `skip_tokenizer_init`; sglang checks the context but not
the ids. Checked here, a bad request fails alone, at its caller, with a
`RequestRejected` (a ValueError) naming the problem, before any engine sees it: the
replica checks every request of a call first (deployments/rollout.py), and each
engine's `generate` checks again as a last guard.

A budget that runs past the context is cut to it rather than refused: the request
ends with stop reason "length" at the context, as vLLM ends such a request itself, so
a multi-turn conversation that grows to the context ends its last turn there instead
of failing its episode, and a run configured with a budget as long as a small model's
context (conf/code.yaml on the 256-token tiny model) still runs. A prompt that leaves
no room for one new token is refused.

Pure: no torch, no engine; `from_config` reads a transformers config.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.seeds import SEED_BITS


class RequestRejected(ValueError):
    """A request no engine may run; its message names the problem. A ValueError, so
    callers that treat bad arguments as such keep doing so; through Ray and Serve the
    client's exception is still an instance of this class (`as_instanceof_cause`)."""


class ContextFull(RequestRejected):
    """The prompt leaves no room in the model's context: a conversation that outgrew
    it, which callers may end as an episode rather than treat as a malformed request."""


@dataclass(frozen=True)
class RequestLimits:
    """`vocab_size`: token ids must be in [0, vocab_size); `max_context`: prompt plus
    generated tokens at most. None: not known (a stand-in engine in tests), so ids are
    only checked to be >= 0 and the context not at all."""
    vocab_size: int | None
    max_context: int | None

    @classmethod
    def from_config(cls, config, max_model_len: int | None = None) -> RequestLimits:
        """From a transformers config (its text part, for multimodal models); the
        engine's own `max_model_len`, when it has one, is the context."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        return cls(getattr(text, "vocab_size", None),
                   max_model_len or getattr(text, "max_position_embeddings", None))

    @classmethod
    def from_pretrained(cls, model_path: str, max_model_len: int | None = None) -> RequestLimits:
        from transformers import AutoConfig
        return cls.from_config(AutoConfig.from_pretrained(model_path), max_model_len)

    def admit(self, req: GenerationRequest) -> GenerationRequest:
        """`req` as an engine may run it: ids as plain ints, the budget cut to what the
        context leaves after the prompt. Raises RequestRejected naming the problem."""
        if not isinstance(req, GenerationRequest):  # e.g. a caller still sending positional args
            raise RequestRejected(f"a generation request is a GenerationRequest "
                                  f"(areal_ray.rollout.engines.base), got {type(req).__name__}")
        ids = self.token_ids(req.input_ids, "prompt token")
        if not ids:
            raise RequestRejected("a generation request needs at least one prompt token")
        budget = _integer(req.max_new_tokens, "max_new_tokens")
        if budget < 0:
            raise RequestRejected(f"max_new_tokens must be >= 0, got {budget}")
        return dataclasses.replace(
            req, input_ids=ids, max_new_tokens=self.fit(len(ids), budget),
            stop_ids=self.token_ids(req.stop_ids, "stop id"),
            temperature=_temperature(req.temperature), seed=_seed(req.seed))

    def admit_all(self, reqs: list[GenerationRequest]) -> list[GenerationRequest]:
        """Every request of one call, checked before any runs: a bad one refuses the
        whole call, naming which, so no engine works for a caller that gets an error."""
        out = []
        for i, req in enumerate(reqs):
            try:
                out.append(self.admit(req))
            except RequestRejected as e:
                raise RequestRejected(f"request {i} of {len(reqs)}: {e}") from None
        return out

    def fit(self, prompt_len: int, budget: int) -> int:
        """`budget`, cut to the room the context leaves after a `prompt_len` prompt."""
        if self.max_context is None:
            return budget
        room = self.max_context - prompt_len
        if room < 1:
            raise ContextFull(f"the prompt is {prompt_len} tokens and the model's context is "
                                  f"{self.max_context}: no room is left to generate")
        return min(budget, room)

    def token_ids(self, ids, what: str) -> list[int]:
        """`ids` as plain ints, each in the vocabulary."""
        try:
            ids = list(ids)
        except TypeError:
            raise RequestRejected(f"the {what}s must be a list of token ids, got "
                                  f"{type(ids).__name__}") from None
        out = [_integer(t, f"{what} {i}") for i, t in enumerate(ids)]
        top = self.vocab_size if self.vocab_size is not None else math.inf
        if out and not (min(out) >= 0 and max(out) < top):
            i, t = next((i, t) for i, t in enumerate(out) if not 0 <= t < top)
            known = f"[0, {self.vocab_size})" if self.vocab_size is not None else "(ids are >= 0)"
            raise RequestRejected(f"{what} {i} is id {t}, outside the model's vocabulary {known}")
        return out


def _integer(value, what: str) -> int:
    if not isinstance(value, bool):  # True is an int to Python, never a token or a budget
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise RequestRejected(f"{what} must be an integer, got {value!r} ({type(value).__name__})")


def _temperature(value) -> float:
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = math.nan
    if isinstance(value, bool) or not math.isfinite(t):
        raise RequestRejected(f"temperature must be a finite number, got {value!r}")
    return t


def _seed(value) -> int | None:
    if value is None:
        return None
    seed = _integer(value, "seed")
    if not 0 <= seed < 2 ** SEED_BITS:  # every engine takes a non-negative int64
        raise RequestRejected(f"seed must be in [0, 2**{SEED_BITS}), got {seed}")
    return seed
