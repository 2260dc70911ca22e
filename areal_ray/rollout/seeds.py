"""Per-request sampling seeds: what a request is decides its random draws, not when it ran.

With one generator per engine, the tokens a request samples depend on every other
request that drew before it: on arrival order, batch composition and timing, which
differ from run to run. A seed derived from the request's identity (the run's seed,
the prompt's stream position, the sample's index in its group, and the index of the
engine call within the sample: resubmissions and turns) gives the same draws in
every run, and an engine that samples each seeded row from its own generator
(hf_engine.py, vLLM's `SamplingParams.seed`) reproduces the tokens exactly where its
numerics are batch-invariant (docs/reproducibility.md).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # every engine takes a non-negative int64 seed


def request_seed(run_seed: int, position: int, sample: int, call: int) -> int:
    """A seed for call `call` of sample `sample` of the prompt at stream `position`."""
    key = f"{run_seed}/{position}/{sample}/{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> (64 - SEED_BITS)
