"""Micro-batching: split a step's sequences into token-balanced micro-batches.

Every data-parallel rank must run the same number of forward/backward passes (FSDP
gathers parameters collectively), so the trainer first agrees on a count k across
ranks, then each rank splits its sequences into exactly k bins. Longest-first greedy
("LPT": each sequence goes to the currently lightest bin) keeps the bins within one
sequence of each other in tokens.
"""

from __future__ import annotations

import heapq
import math


def count_microbatches(lengths: list[int], max_tokens: int) -> int:
    """Fewest micro-batches whose average fill stays within `max_tokens`."""
    if not lengths:
        return 0
    return max(1, math.ceil(sum(lengths) / max_tokens), math.ceil(max(lengths) / max_tokens))


def split_balanced(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` in k bins, balanced by total length; no bin empty if k <= n."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > len(lengths):
        raise ValueError(f"cannot fill {k} micro-batches from {len(lengths)} sequences")
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins]
