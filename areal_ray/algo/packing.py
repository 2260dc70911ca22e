"""Padding-free packing: a micro-batch as one row of concatenated sequences.

Sequences are laid end to end in a single row with per-sequence position ids, so no
compute goes to padding. On CPU (sdpa/eager attention) a block-diagonal causal mask
keeps attention from crossing sequence boundaries; with flash-attention on GPUs,
transformers derives the varlen boundaries (cu_seqlens) from the position ids that
restart at 0, and the O(T^2) mask is not built (`build_mask=False`).

Next-token alignment follows `logprobs.pad_batch`: position i holds the logprob of
token i+1, and only positions whose next token is an output token of the *same*
sequence are in the loss mask (the last token of one sequence never "predicts" the
first token of the next). "seq_ids" (length T-1, like the other targets) names each
output token's sequence, -1 elsewhere; the per-input-token segments that build the
attention mask are not returned, since `cu_seqlens` carries the same boundaries.
"""

from __future__ import annotations

import torch

from areal_ray.algo.logprobs import CHUNK_BYTES, logprob_head, write_targets


def pack(seqs: list[dict], build_mask: bool = True) -> dict[str, torch.Tensor]:
    """seqs: dicts with prompt_ids, output_ids, logprobs, versions, advantage."""
    ids, pos, seg = [], [], []
    lens = []
    for k, s in enumerate(seqs):
        toks = list(s["prompt_ids"]) + list(s["output_ids"])
        ids += toks
        pos += range(len(toks))
        seg += [k] * len(toks)
        lens.append(len(toks))
    total = len(ids)
    out = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32),
        "loss_mask": torch.zeros(total - 1, dtype=torch.bool),
        "behavior_logprobs": torch.zeros(total - 1),
        "advantages": torch.zeros(total - 1),
        "versions": torch.full((total - 1,), -1, dtype=torch.long),
        "seq_ids": torch.full((total - 1,), -1, dtype=torch.long),
    }
    start = 0
    for k, (s, n) in enumerate(zip(seqs, lens)):
        write_targets(out, start, s, k)
        start += n
    if build_mask:
        segments = torch.tensor(seg, dtype=torch.long)
        same = segments[:, None] == segments[None, :]
        causal = torch.tril(torch.ones(total, total, dtype=torch.bool))
        out["attention_mask"] = (same & causal)[None, None]
    return out


def packed_token_logprobs(model, packed: dict[str, torch.Tensor], temperature: float = 1.0,
                          chunk_bytes: int = CHUNK_BYTES, entropy: str | None = None) -> torch.Tensor:
    """[T-1] log-probabilities of input_ids[1:] (garbage across boundaries: masked out);
    [T-1, 2] with `entropy` (algo/logprobs.py: logprob and entropy)."""
    kwargs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    if "attention_mask" in packed:
        kwargs["attention_mask"] = packed["attention_mask"]
    with logprob_head(model, packed["input_ids"], temperature, chunk_bytes, entropy):
        return model(**kwargs).logits[0]
