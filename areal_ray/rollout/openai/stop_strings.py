"""Stop strings longer than one token on the OpenAI endpoint.

The engines stop on token ids only. A stop string that encodes to several tokens is
caught in two ways, both keeping the tokens exactly as sampled:

- the engine pauses at the string's last token (a stop id) and, when the text does not
  end with the whole string, generation goes on from prompt + output with the budget
  left (the resubmission of interruptible rollout: nothing is re-encoded), so the
  common case costs no extra tokens;
- whatever ended generation (a pause, EOS, the budget), the output is cut after the
  first token whose text completes one of the strings. This also catches a string the
  model wrote with another tokenization than `encode(stop)`; the tokens past it were
  sampled but are neither returned nor recorded, as OpenAI ends the output there.

As for one-token stops, the string stays at the end of the returned text, so the
history the agent sends back is what the model generated (sessions.py chains on it).
A pause counts as a resubmission in the recorded call's `n_resubmits`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from areal_ray.rollout.interruptible import PartialSample


def first_stop(ids: list[int], strings: list[str], decode: Callable[[list[int]], str]) -> int | None:
    """The fewest leading tokens of `ids` whose text contains one of `strings` (None:
    the whole text contains none). A prefix's text grows with the prefix, so this is
    a binary search: a few decodes, not one per token."""
    if not strings or not any(s in decode(ids) for s in strings):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in strings):
            hi = mid
        else:
            lo = mid + 1
    return lo


async def run_to_stop_strings(run: Callable[[], Awaitable[None]], part: PartialSample,
                              strings: list[str], pause_ids: set[int],
                              decode: Callable[[list[int]], str]) -> None:
    """`run()` generates `part` to the engine's stop; repeated while the engine only
    paused at a stop string's last token, then the output cut at the first string."""
    while True:
        await run()
        k = first_stop(part.out_ids, strings, decode)
        if k is not None:
            part.out_ids, part.logprobs, part.versions = (
                part.out_ids[:k], part.logprobs[:k], part.versions[:k])
            part.reason = "stop"
            return
        paused = part.reason == "stop" and part.out_ids and part.out_ids[-1] in pause_ids
        if not paused:
            return
        if len(part.out_ids) >= part.max_new_tokens:
            part.reason = "length"  # the budget ended it, not a stop
            return
        part.reason = "abort"  # reopened: the next call resubmits prompt + output
