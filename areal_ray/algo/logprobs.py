"""Token tensors for training and teacher-forced logprobs.

`pad_batch` right-pads prompt+output sequences and builds, aligned with next-token
prediction (position i holds the logprob of token i+1), the loss mask over output
tokens, the behaviour logprobs, the per-token advantages, the per-token versions and
the per-token sequence index (which sequence-level objectives such as GSPO group by).
`token_logprobs` runs the model and returns log softmax(logits / T) at the next
tokens: the same quantity the engine reports, so pi_theta/pi_behav is exact.
"""

from __future__ import annotations

import torch

TARGETS = ("loss_mask", "behavior_logprobs", "advantages", "versions", "seq_ids")


def write_targets(row: dict[str, torch.Tensor], start: int, seq: dict, index: int) -> None:
    """Fill the per-token targets of one sequence that begins at `start` in `row`
    (1-D tensors keyed by TARGETS): its output tokens are predicted at positions
    start + len(prompt) - 1 onwards. Shared by the padded and the packed layouts.

    `index` is the sequence's position in the micro-batch; it is written to
    "seq_ids" (which stays -1 off the output tokens) because in the packed layout
    nothing else tells a token which sequence it belongs to."""
    p, o = len(seq["prompt_ids"]), len(seq["output_ids"])
    sl = slice(start + p - 1, start + p - 1 + o)
    row["loss_mask"][sl] = True
    row["behavior_logprobs"][sl] = torch.tensor(seq["logprobs"], dtype=torch.float32)
    row["advantages"][sl] = float(seq["advantage"])
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


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """[B, L-1] log-probabilities of input_ids[:, 1:] under the model."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
