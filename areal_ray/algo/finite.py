"""Non-finite numbers (NaN, inf) are refused where they enter training.

One NaN in a reward, an advantage or a behaviour logprob makes the loss NaN, then
every gradient, and after one optimizer step every weight, silently: nothing
downstream fails. So each sequence's inputs are screened when the batch is built
(`screen`), and a sequence that holds one is left out of the batch, named. Finite
inputs can still overflow in the loss or the gradients; train/step.py guards those.
"""

from __future__ import annotations

import math


def nonfinite(seq: dict) -> str | None:
    """Which input of a training sequence is not finite, e.g. "advantage nan" or
    "behaviour logprob -inf at token 3"; None when all are."""
    for key in ("reward", "advantage"):
        value = seq.get(key)
        if value is not None and not math.isfinite(value):
            return f"{key} {value}"
    logprobs = seq.get("logprobs") or ()
    # One C-level sum is NaN or infinite if any term is; only then look for which.
    if not math.isfinite(sum(logprobs)):
        for i, lp in enumerate(logprobs):
            if not math.isfinite(lp):
                return f"behaviour logprob {lp} at token {i}"
    return None


def name(seq: dict, index: int) -> str:
    """The sequence in messages: its group's ticket and place in the group when known."""
    if "ticket" in seq and "sample" in seq:
        return f"ticket {seq['ticket']} sample {seq['sample']}"
    return f"sequence {index}"


def screen(seqs: list[dict]) -> tuple[list[dict], list[str]]:
    """The sequences whose inputs are all finite, in order, and one line for each
    that is left out, naming it and the value."""
    kept, refused = [], []
    for i, seq in enumerate(seqs):
        why = nonfinite(seq)
        if why is None:
            kept.append(seq)
        else:
            refused.append(f"{name(seq, i)}: {why}")
    return kept, refused
