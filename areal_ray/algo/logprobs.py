"""Token tensors for training and teacher-forced logprobs.

`pad_batch` right-pads prompt+output sequences and builds, aligned with next-token
prediction (position i holds the logprob of token i+1), the loss mask over output
tokens, the behaviour logprobs, the per-token advantages and the per-token versions.
`token_logprobs` runs the model and returns log softmax(logits / T) at the next
tokens: the same quantity the engine reports, so pi_theta/pi_behav is exact.
"""

from __future__ import annotations

import torch


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
    }
    for i, s in enumerate(seqs):
        p, o = len(s["prompt_ids"]), len(s["output_ids"])
        out["input_ids"][i, : p + o] = torch.tensor(s["prompt_ids"] + s["output_ids"])
        out["attention_mask"][i, : p + o] = 1
        sl = slice(p - 1, p - 1 + o)
        out["loss_mask"][i, sl] = True
        out["behavior_logprobs"][i, sl] = torch.tensor(s["logprobs"], dtype=torch.float32)
        out["advantages"][i, sl] = float(s["advantage"])
        out["versions"][i, sl] = torch.tensor(s["versions"], dtype=torch.long)
    return out


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """[B, L-1] log-probabilities of input_ids[:, 1:] under the model."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
