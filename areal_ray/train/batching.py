"""A step's sequences -> this rank's micro-batches, the same count on every rank.

Whole prompt groups go to data-parallel ranks, balanced by tokens. Each rank then
fills micro-batches up to `algo.microbatch.max_tokens` tokens: packed (one row of
concatenated sequences, no padding; the default) by first-fit decreasing, or padded
(right-padded rows) by longest-first greedy. Ranks agree on the micro-batch count by
all-reduce; a rank with fewer sequences than bins runs an empty micro-batch as a
zero-weight forward/backward so FSDP's collectives stay in step. Micro-batches are
built on the CPU; `to_device` puts one on the model's device before its passes.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from areal_ray.algo.logprobs import CHUNK_BYTES, pad_batch, token_logprobs
from areal_ray.algo.microbatch import (
    assign_groups,
    count_microbatches,
    ffd,
    split_balanced,
)
from areal_ray.algo.packing import pack, packed_token_logprobs
from areal_ray.train.fsdp import model_device
from areal_ray.train.memory import DecoderShape


def uses_varlen(config) -> bool:
    """Whether the model's attention is a flash kernel, which takes a packed row's
    sequence boundaries from its position ids (so no dense mask may be passed). Decided
    as transformers decides it: any implementation with "flash" in its name, including
    the hub kernels ("kernels-community/flash-attn2") that transformers 5.19 switches to
    when the flash-attn package is missing; a prefix test missed those and sent them a
    dense 4-D mask."""
    from transformers.utils.generic import is_flash_attention_requested
    return is_flash_attention_requested(
        requested_attention_implementation=getattr(config, "_attn_implementation", None))


def comm_device() -> torch.device:
    """Where a tensor of a collective on the default group must be: NCCL (Ray Train's
    group with `train.use_gpu`) takes only CUDA tensors, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def to_device(mb: dict | None, device: torch.device) -> dict | None:
    """The micro-batch with its tensors on `device` (a no-op for tensors already there);
    other values and empty slots (None) unchanged."""
    if mb is None:
        return None
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def seq_len(s: dict) -> int:
    return len(s["prompt_ids"]) + len(s["output_ids"])


def rank_share(seqs: list[dict], rank: int, world: int) -> list[dict]:
    """This rank's sequences: whole groups (by ticket), token-balanced across ranks."""
    if world == 1:
        return seqs
    groups: dict[int, list[dict]] = defaultdict(list)
    for s in seqs:
        groups[s["ticket"]].append(s)
    order = sorted(groups)
    if len(order) < world:  # too few groups to keep them whole: split sequences
        return seqs[rank::world]
    parts = assign_groups([sum(seq_len(s) for s in groups[t]) for t in order], world)
    return [s for i in parts[rank] for s in groups[order[i]]]


def split_minibatches(mine: list[dict], n: int) -> list[list[dict]]:
    """`n` PPO minibatches (one optimizer step each) of whole groups, in ticket order;
    some may be empty on a rank with few groups (it then runs empty micro-batches)."""
    tickets = sorted({s["ticket"] for s in mine})
    chunks = [tickets[i * len(tickets) // n:(i + 1) * len(tickets) // n] for i in range(n)]
    return [[s for s in mine if s["ticket"] in set(c)] for c in chunks]


# Longest packed row under a dense block-diagonal mask (sdpa/eager) on CPU: attention
# over a row of T tokens costs O(T^2) whatever the mask hides, so one 2,000-token row
# of the quickstart's batch trained at half the speed of the same tokens in rows of at
# most 512 (or padded rows). Varlen kernels pay only per sequence.
DENSE_ROW_TOKENS = 512


def dense_row_tokens(config, device: torch.device) -> int:
    """The longest packed row under a dense mask for this model on this device.

    On CPU, DENSE_ROW_TOKENS (measured there). On a GPU a step's time at these sizes
    goes mostly per micro-batch (on an H200, Qwen2.5-1.5B's shape trained 320-token
    micro-batches at ~1,000 tokens/s and 1,280-token ones at ~4,300), so a row may grow
    until attention over it costs a quarter of the row's other work: per token, 4 FLOPs
    per query dimension, layer and key of the row, against 2 per parameter. About 4,500
    tokens for Qwen2.5-1.5B; never below the CPU cap."""
    if device.type != "cuda":
        return DENSE_ROW_TOKENS
    try:
        shape = DecoderShape.from_hf(config)
    except AttributeError:  # not a Qwen2/Llama-style config: keep the measured cap
        return DENSE_ROW_TOKENS
    return max(DENSE_ROW_TOKENS, shape.params // (8 * shape.q_dim * shape.layers))


def build_microbatches(mine: list[dict], max_tokens: int, packed: bool,
                       pad_id: int, varlen: bool = False,
                       dense_row: int = DENSE_ROW_TOKENS) -> list[dict | None]:
    """`varlen`: the model runs flash-attention, which finds the sequence boundaries of
    a packed row from its position ids, so no O(T^2) block-diagonal mask is built and
    a row may fill the whole budget; otherwise rows stop at `dense_row` tokens
    (`dense_row_tokens`)."""
    lengths = [seq_len(s) for s in mine]
    if packed:
        max_tokens = max_tokens if varlen else min(max_tokens, dense_row)
        bins = ffd(lengths, max_tokens)
        while True:  # agree on one count; FFD with more bins never needs fewer
            k = int(all_reduce([len(bins)], dist.ReduceOp.MAX)[0])
            bins = ffd(lengths, max_tokens, min_bins=k)
            if int(all_reduce([len(bins)], dist.ReduceOp.MAX)[0]) == k == len(bins):
                break
        return [pack([mine[i] for i in b], build_mask=not varlen) if b else None for b in bins]
    k = int(all_reduce([count_microbatches(lengths, max_tokens)], dist.ReduceOp.MAX)[0])
    bins = split_balanced(lengths, k) if k <= len(lengths) else \
        split_balanced(lengths, len(lengths)) + [[]] * (k - len(lengths))
    return [pad_batch([mine[i] for i in b], pad_id) if b else None for b in bins]


def forward_logprobs(model, mb: dict, temperature: float, chunk_bytes: int = CHUNK_BYTES,
                     entropy: str | None = None) -> torch.Tensor:
    """A micro-batch's token logprobs, packed or padded; with `entropy` ("value" or
    "grad", algo/logprobs.py) each position's entropy beside them, in a last axis of 2."""
    if "position_ids" in mb:
        return packed_token_logprobs(model, mb, temperature, chunk_bytes, entropy)
    return token_logprobs(model, mb["input_ids"], mb["attention_mask"], temperature, chunk_bytes,
                          entropy)


def empty_forward(model, pad_id: int) -> torch.Tensor:
    """A zero-valued loss through the whole model (keeps FSDP collectives in step)."""
    return model(input_ids=torch.tensor([[pad_id]], device=model_device(model))).logits.sum() * 0.0
