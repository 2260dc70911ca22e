"""Token tensors for training and teacher-forced logprobs.

`pad_batch` right-pads prompt+output sequences and builds, aligned with next-token
prediction (position i holds the logprob of token i+1), the loss mask over output
tokens, the behaviour logprobs, the per-token advantages, the per-token versions and
the per-token sequence index (which sequence-level objectives such as GSPO group by).
`token_logprobs` runs the model and returns log softmax(logits / T) at the next
tokens: the same quantity the engine reports, so pi_theta/pi_behav is exact.

Memory. The full fp32 logits of a micro-batch are T x V x 4 bytes: 6.2 GB for 10k
tokens of Qwen2.5's 151,936-entry vocabulary, plus as much again for log_softmax and
its gradient. So the model's output projection is replaced, for the duration of one
forward (`logprob_head`), by one that returns the targets' logprobs directly,
computing at most `chunk_bytes` of fp32 logits at a time; above one chunk each chunk
runs under activation checkpointing, so the backward recomputes it instead of
keeping it. The projection still runs inside the model's forward, where FSDP has its
(possibly tied) weight gathered.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Default fp32 logits per chunk (train.logits_chunk_mb).
CHUNK_BYTES = 256 << 20

TARGETS = ("loss_mask", "behavior_logprobs", "advantages", "versions", "seq_ids")


def write_targets(row: dict[str, torch.Tensor], start: int, seq: dict, index: int) -> None:
    """Fill the per-token targets of one sequence that begins at `start` in `row`
    (1-D tensors keyed by TARGETS): its output tokens are predicted at positions
    start + len(prompt) - 1 onwards. Shared by the padded and the packed layouts. A
    multi-turn sequence's `loss_mask` (1 per policy token) keeps the tool tokens out.

    `index` is the sequence's position in the micro-batch; it is written to
    "seq_ids" (which stays -1 off the output tokens) because in the packed layout
    nothing else tells a token which sequence it belongs to."""
    p, o = len(seq["prompt_ids"]), len(seq["output_ids"])
    sl = slice(start + p - 1, start + p - 1 + o)
    mask = seq.get("loss_mask")
    row["loss_mask"][sl] = True if mask is None else torch.tensor(mask, dtype=torch.bool)
    row["behavior_logprobs"][sl] = torch.tensor(seq["logprobs"], dtype=torch.float32)
    # per-token advantages where a sequence has its own (on-policy distillation, areal_ray/distill/)
    token_adv = seq.get("token_advantages")
    row["advantages"][sl] = float(seq["advantage"]) if token_adv is None \
        else torch.tensor(token_adv, dtype=torch.float32)
    row["versions"][sl] = torch.tensor(seq["versions"], dtype=torch.long)
    row["seq_ids"][sl] = index


def pad_batch(seqs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """seqs: dicts with prompt_ids, output_ids, logprobs, versions, advantage."""
    width = max(len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs)
    n = len(seqs)
    out = {
        "input_ids": torch.full((n, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((n, width), dtype=torch.long),
        "loss_mask": torch.zeros((n, width - 1), dtype=torch.bool),
        "behavior_logprobs": torch.zeros((n, width - 1)),
        "advantages": torch.zeros((n, width - 1)),
        "versions": torch.full((n, width - 1), -1, dtype=torch.long),
        "seq_ids": torch.full((n, width - 1), -1, dtype=torch.long),
    }
    for i, s in enumerate(seqs):
        p, o = len(s["prompt_ids"]), len(s["output_ids"])
        out["input_ids"][i, : p + o] = torch.tensor(s["prompt_ids"] + s["output_ids"])
        out["attention_mask"][i, : p + o] = 1
        write_targets({k: out[k][i] for k in TARGETS}, 0, s, i)
    return out


# What `chunked_logprobs(entropy=...)` adds beside each logprob: nothing, the token
# entropy as a value (no gradient: a metric), or with its gradient (an entropy bonus).
ENTROPY = (None, "value", "grad")


def _entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) z, from the chunk's own logits: one more
    [rows, V] tensor (the probabilities) per chunk, never a second forward."""
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _chunk_logprobs(h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor,
                    temperature: float, entropy: str | None = None) -> torch.Tensor:
    logits = F.linear(h, weight, bias).float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if entropy is None:
        return logp
    if entropy == "value":
        with torch.no_grad():
            ent = _entropy(logits.detach(), lse.detach())
    else:
        ent = _entropy(logits, lse)
    return torch.stack([logp, ent], dim=-1)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor,
                     temperature: float = 1.0, chunk_bytes: int = CHUNK_BYTES,
                     entropy: str | None = None) -> torch.Tensor:
    """log softmax(hidden @ weight.T + bias) / T at `targets`, for hidden [..., H] and
    targets [...]; at most `chunk_bytes` of fp32 logits exist at once, forward or backward.

    `entropy` ("value" or "grad", see ENTROPY): the output is [..., 2], the logprob and
    the entropy of the tempered distribution at each position; the logprobs are the
    same bits as without it."""
    if entropy not in ENTROPY:
        raise ValueError(f"entropy must be one of {ENTROPY}, got {entropy!r}")
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    shape = targets.shape if entropy is None else (*targets.shape, 2)
    if targets.numel() <= rows:  # one chunk: nothing to gain from recomputing it
        return _chunk_logprobs(hidden, weight, bias, targets, temperature, entropy)
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    parts = [checkpoint(_chunk_logprobs, h[i:i + rows], weight, bias, t[i:i + rows], temperature,
                        entropy, use_reentrant=False)
             for i in range(0, h.shape[0], rows)]
    # A copy, not a view: FSDP2 hooks its backward onto the module's output.
    return torch.cat(parts).reshape(shape).clone()


@contextmanager
def logprob_head(model, input_ids: torch.Tensor, temperature: float, chunk_bytes: int,
                 entropy: str | None = None):
    """While active, `model(...).logits` is [B, L-1]: the logprob of input_ids[:, 1:]
    ([B, L-1, 2] with the entropy beside it, `entropy` as in `chunked_logprobs`: the
    entropy leaves the model as its output, so FSDP sees its gradient like the
    logprobs')."""
    head = model.get_output_embeddings()
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} caps its logits; the chunked logprob head "
                         "computes plain log-softmax and would differ from the engine's")
    targets = input_ids[:, 1:]

    def forward(hidden):
        return chunked_logprobs(hidden[:, :-1], head.weight, head.bias, targets, temperature,
                                chunk_bytes, entropy)
    head.forward = forward  # an instance attribute: parameter names stay the same
    try:
        yield
    finally:
        del head.forward


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, chunk_bytes: int = CHUNK_BYTES,
                   entropy: str | None = None) -> torch.Tensor:
    """[B, L-1] log-probabilities of input_ids[:, 1:] under the model ([B, L-1, 2] with
    `entropy`: logprob and entropy)."""
    with logprob_head(model, input_ids, temperature, chunk_bytes, entropy):
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


def shared_model_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          temperature: float = 1.0, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """`token_logprobs`, bit for bit, without patching the model's head: the decoder's
    hidden states through the same chunked head. For a model other threads run forwards
    on at the same time (an engine's probe beside its scheduler), whose head
    `logprob_head` would change under them."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} caps its logits; the chunked logprob head "
                         "computes plain log-softmax and would differ from the engine's")
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    head = model.get_output_embeddings()
    return chunked_logprobs(hidden[:, :-1], head.weight, head.bias, input_ids[:, 1:], temperature,
                            chunk_bytes)
