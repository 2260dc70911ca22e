"""SFT rows -> token sequences the trainer packs: prompt tokens, then completion tokens.

A row is `{"prompt": str, "completion": str}` (the text is `prompt + completion`, no
template) or `{"messages": [..., {"role": "assistant", "content": str}]}`, whose prompt
is the tokenizer's chat template over the messages before the last, with the
generation prompt, and whose completion is the last message's content. Either way the
whole text is encoded at once, as generation sees it, and a token belongs to the
completion when it starts at or after the prompt's end (the offsets; a token that
straddles the boundary is the prompt's). The completion ends with the tokenizer's eos,
as the warm starts' examples do (task/tiny_model.py: encode_sft), so the model learns
to stop. Only completion tokens are trained (`loss_mask` of the packed rows).

A row longer than `max_len` tokens loses its end; a row left without a completion
token is an error naming it. Every problem names the row's place (`path:line`).
The embedded data is the arith task's generator (task/arith.py), the one the tiny
model's warm start is trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from areal_ray.data.sources import DatasetError, read_rows
from areal_ray.task import arith

# seeds of the embedded rows, apart from RL's prompt streams (data/prompts.py) and the
# warm start's dev split (task/tiny_model.py): train + task.seed, eval + task.seed
SFT_TRAIN_SEED = 31_000_000
SFT_EVAL_SEED = 32_000_000


@dataclass(frozen=True)
class SftRow:
    where: str
    prompt_ids: list[int]
    output_ids: list[int]


def row_text(where: str, row, tok) -> tuple[str, str]:
    """(prompt, completion) text of a row, or a DatasetError naming `where`."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be an object with prompt and completion, "
                           f"or messages; got {type(row).__name__}")
    if "messages" in row:
        return _chat_text(where, row["messages"], tok)
    for key in ("prompt", "completion"):
        if key not in row:
            raise DatasetError(f"{where}: the row has no {key!r} (a row is {{prompt, completion}} "
                               f"or {{messages}}; it has {sorted(row)})")
        if not isinstance(row[key], str):
            raise DatasetError(f"{where}: {key!r} must be a string, got {type(row[key]).__name__}")
    if not row["completion"]:
        raise DatasetError(f"{where}: the completion is empty: nothing to train on")
    return row["prompt"], row["completion"]


def _chat_text(where: str, messages, tok) -> tuple[str, str]:
    if not isinstance(messages, list) or not messages or \
            not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise DatasetError(f"{where}: messages must be a non-empty list of {{role, content}} "
                           "objects with string contents")
    last = messages[-1]
    if last.get("role") != "assistant" or not last["content"]:
        raise DatasetError(f"{where}: the last message must be the assistant's, with the "
                           f"completion as its content (got role {last.get('role')!r})")
    if not getattr(tok, "chat_template", None):
        raise DatasetError(f"{where}: a messages row needs a tokenizer with a chat template; "
                           "this model's has none (write {prompt, completion} rows)")
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True) \
        if len(messages) > 1 else ""
    return prompt, last["content"]


def encode(where: str, prompt: str, completion: str, tok, max_len: int) -> SftRow:
    """The row's tokens, the completion's ending with eos, cut to `max_len`."""
    enc = tok(prompt + completion, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"]) + [tok.eos_token_id]
    n_prompt = sum(start < len(prompt) for start, _ in enc["offset_mapping"])
    ids = ids[:max_len]
    if n_prompt >= len(ids):
        raise DatasetError(f"{where}: no completion token is left within sft.max_len={max_len} "
                           f"(the prompt alone is {n_prompt} tokens): shorten the prompt or raise "
                           "sft.max_len")
    if n_prompt == 0:
        raise DatasetError(f"{where}: the prompt is empty: the first completion token would "
                           "have nothing to be predicted from")
    return SftRow(where, ids[:n_prompt], ids[n_prompt:])


def file_rows(spec: str, tok, max_len: int, max_row_bytes: int) -> list[SftRow]:
    out = []
    for where, row in read_rows(spec, max_row_bytes):
        out.append(encode(where, *row_text(where, row, tok), tok, max_len))
    return out


def embedded_rows(seed: int, n: int, tok, max_len: int, max_steps: int, p_stop: float,
                  p_direct: float) -> list[SftRow]:
    """`n` arith problems with their worked (or, at `p_direct`, bare) solutions."""
    return [encode(f"arith seed {seed} row {i}", p.prompt, p.solution, tok, max_len)
            for i, p in enumerate(arith.make_split(seed, n, max_steps, p_stop, p_direct))]


def load_rows(cfg, tok) -> tuple[list[SftRow], list[SftRow]]:
    """(train, held-out) rows of `cfg.sft` (module docstring)."""
    s, t = cfg.sft, cfg.task
    if s.train_path:
        train = file_rows(s.train_path, tok, s.max_len, t.max_row_bytes)
        if s.eval_path:
            held = file_rows(s.eval_path, tok, s.max_len, t.max_row_bytes)
        else:
            if s.n_eval >= len(train):
                raise DatasetError(f"{s.train_path}: {len(train)} rows, so sft.n_eval={s.n_eval} "
                                   "would leave none to train on; lower sft.n_eval or set sft.eval_path")
            train, held = train[:len(train) - s.n_eval], train[len(train) - s.n_eval:]
        return train, held
    if t.embedded != "arith":
        raise DatasetError(f"sft.train_path is empty and task.embedded={t.embedded}: the SFT job "
                           "embeds only the arith task's data; set sft.train_path")
    gen = dict(tok=tok, max_len=s.max_len, max_steps=t.max_steps_per_problem, p_stop=t.chain_p_stop,
               p_direct=s.p_direct)
    train = embedded_rows(SFT_TRAIN_SEED + t.seed, s.n_train, **gen)
    held = file_rows(s.eval_path, tok, s.max_len, t.max_row_bytes) if s.eval_path else \
        embedded_rows(SFT_EVAL_SEED + t.seed, s.n_eval, **gen)
    return train, held


def step_indices(n_rows: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The rows of optimizer step `step`: the training rows taken in order of a fresh
    permutation per epoch (seeded by `seed` and the epoch), `batch_size` at a time; a
    batch that crosses an epoch's end takes the next epoch's first rows. A function of
    the step alone, so a resumed run continues exactly where the checkpoint was."""
    out, perms = [], {}
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch = pos // n_rows
        if epoch not in perms:
            perms[epoch] = random.Random(seed * 1_000_003 + epoch).sample(range(n_rows), n_rows)
        out.append(perms[epoch][pos % n_rows])
    return out


def as_seqs(rows: list[SftRow]) -> list[dict]:
    """The rows as the trainer's micro-batching takes sequences (train/batching.py):
    every completion token in the loss mask; behaviour logprobs, versions and
    advantages are RL's and unused here; each row its own group for the ranks' split."""
    return [{"prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
             "logprobs": [0.0] * len(r.output_ids), "versions": [0] * len(r.output_ids),
             "advantage": 0.0, "ticket": i} for i, r in enumerate(rows)]
