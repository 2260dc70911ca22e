"""Prompt datasets: the embedded arithmetic task, or jsonl files on disk.

A row is `{"uid", "prompt", "verifier", ...}`: a `math` row has an `answer`, a `code`
row has `tests` (a list of `{"input", "output"}` stdin/stdout pairs, carried on as a
JSON string in `answer`); extra keys are kept. Rows are
checked when loaded, so a malformed dataset is an error naming the file and line
before any rollout starts. Training consumes exactly `steps * batch_groups` prompts:
the split is cycled epoch by epoch, reshuffled with `seed + epoch`, each prompt used
once per epoch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from areal_ray.reward.code import check_tests
from areal_ray.reward.pool import VERIFIERS
from areal_ray.task.arith import make_split

EMBEDDED_TRAIN_SEED, EMBEDDED_EVAL_SEED = 1_000, 2_000_000


class DatasetError(ValueError):
    pass


def check_row(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    verifier = row.setdefault("verifier", "math")
    if verifier not in VERIFIERS:
        raise DatasetError(f"{where}: verifier {verifier!r} is not one of {VERIFIERS}")
    if verifier == "code":
        try:
            row["answer"] = json.dumps(check_tests(row.get("tests")))
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from e
    for key in ("prompt", "answer"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise DatasetError(f"{where}: field {key!r} must be a non-empty string")
    row.setdefault("uid", where)
    return row


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{i}: not valid JSON ({e.msg})") from e
        rows.append(check_row(row, f"{path}:{i}"))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def embedded_rows(seed: int, n: int, max_steps: int) -> list[dict]:
    return [p.to_row(f"arith-{seed}-{i}") for i, p in enumerate(make_split(seed, n, max_steps))]


def train_rows(task, n_needed: int) -> list[dict]:
    """Exactly `n_needed` prompts, in training order."""
    if not task.train_path:
        return embedded_rows(EMBEDDED_TRAIN_SEED + task.seed, n_needed, task.max_steps_per_problem)
    split = read_jsonl(task.train_path)
    out, epoch = [], 0
    while len(out) < n_needed:
        order = list(split)
        random.Random(task.seed + epoch).shuffle(order)
        out += [dict(r, epoch=epoch) for r in order]
        epoch += 1
    return out[:n_needed]


def eval_rows(task) -> list[dict]:
    if not task.eval_path:
        return embedded_rows(EMBEDDED_EVAL_SEED + task.seed, task.n_eval, task.max_steps_per_problem)
    return read_jsonl(task.eval_path)[: task.n_eval]
