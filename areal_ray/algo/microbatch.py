"""Micro-batching: split a step's sequences into token-budgeted micro-batches.

Every data-parallel rank must run the same number of forward/backward passes (FSDP
gathers parameters collectively), so ranks agree on a count k and each splits its
sequences into exactly k bins:
  * `ffd`: first-fit decreasing under a token budget (for packed micro-batches);
  * `split_balanced`: longest-first greedy into k bins ("LPT"), used for padded
    micro-batches and to hand whole prompt groups to ranks (`assign_groups`).
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


def ffd(lengths: list[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """First-fit decreasing into bins of at most `max_tokens` (AReaL's variant: among
    the bins a sequence fits in, the one holding the fewest sequences). At least
    `min_bins` bins, which is how ranks agree on one micro-batch count; a sequence
    longer than the budget gets a bin of its own. Bins may be empty when there are
    fewer sequences than `min_bins`."""
    bins: list[list[int]] = [[] for _ in range(max(1, min_bins))]
    loads = [0] * len(bins)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fitting = [b for b in range(len(bins))
                   if loads[b] + lengths[i] <= max_tokens or not bins[b]]
        if not fitting:
            bins.append([])
            loads.append(0)
            fitting = [len(bins) - 1]
        b = min(fitting, key=lambda b: (len(bins[b]), loads[b]))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def assign_groups(group_tokens: list[int], world: int) -> list[list[int]]:
    """Whole prompt groups to data-parallel ranks, balanced by tokens."""
    if len(group_tokens) < world:
        raise ValueError(f"{len(group_tokens)} groups cannot feed {world} ranks")
    return split_balanced(group_tokens, world)
