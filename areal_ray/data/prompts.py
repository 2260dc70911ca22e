"""Prompt datasets: an embedded task (`task.embedded`: arith, tool_arith, chain_arith), or dataset
files on disk (sources.py).

A row is `{"uid", "prompt", "verifier", ...}`: a `math` row has an `answer`, a `code`
row has `tests` (a list of `{"input", "output"}` stdin/stdout pairs, carried on as a
JSON string in `answer`); extra keys are kept. A dataset with other columns (GSM8K's
`question` and `answer`) is mapped by `task.prompt_template`, `task.answer_field` and
`task.answer_pattern` (docs/data.md). Rows are mapped and checked when loaded, in
`check_row` alone, so a malformed dataset is an error naming the file and row before
any rollout starts (for a large training set, its first rows: stream.py). The order
in which training consumes prompts is the prompt stream (stream.py).
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from areal_ray.config import ConfigError
from areal_ray.data.sources import DatasetError, iter_rows, read_rows
from areal_ray.reward.code import check_tests
from areal_ray.reward.registry import BUILTIN
from areal_ray.task import arith, chains, tool_arith

EMBEDDED_TRAIN_SEED, EMBEDDED_EVAL_SEED = 1_000, 2_000_000
BUILT_IN = tuple(BUILTIN)  # math, code, chain; a run's reward.checkers add more

__all__ = ["DatasetError", "Fields", "check_row", "read_prompts", "train_stream", "train_rows", "eval_rows"]


@dataclass(frozen=True)
class Fields:
    """How a dataset's own fields become a row's prompt and answer."""
    template: str = ""
    answer_field: str = "answer"
    pattern: re.Pattern | None = None
    verifiers: tuple[str, ...] = BUILT_IN  # the names a row may give (reward/registry.py)

    @classmethod
    def of(cls, task, verifiers: tuple[str, ...] = BUILT_IN) -> Fields:
        """From the task config; a template or regex that cannot work fails here, once,
        rather than on every row."""
        try:
            names = [n for _, n, _, _ in string.Formatter().parse(task.prompt_template) if n is not None]
        except ValueError as e:
            raise ConfigError(f"task.prompt_template: {e} (a literal brace is written {{{{ or }}}})") from e
        if any(n == "" or n.isdigit() for n in names):
            raise ConfigError("task.prompt_template: fields must be named after the row's fields, "
                              "e.g. {question}, not {} or {0}")
        try:
            pattern = re.compile(task.answer_pattern) if task.answer_pattern else None
        except re.error as e:
            raise ConfigError(f"task.answer_pattern: not a valid regex ({e})") from e
        return cls(task.prompt_template, task.answer_field, pattern, tuple(verifiers))


PLAIN = Fields()


def _prompt(row: dict, where: str, template: str) -> str:
    try:
        return template.format_map(row)
    except KeyError as e:
        raise DatasetError(f"{where}: task.prompt_template needs field {e.args[0]!r}; "
                           f"the row has {sorted(row)}") from e
    except (AttributeError, IndexError, TypeError, ValueError) as e:
        raise DatasetError(f"{where}: task.prompt_template cannot be filled from this row ({e})") from e


def _answer(row: dict, where: str, fields: Fields) -> object:
    name = fields.answer_field
    if name not in row or row[name] is None:
        raise DatasetError(f"{where}: field {name!r} is missing (task.answer_field); "
                           f"the row has {sorted(row)}")
    value = row[name]
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # integer columns are common in parquet; the verifier compares text
    if fields.pattern is None or not isinstance(value, str):
        return value  # a non-string is reported by check_row's type check
    m = fields.pattern.search(value)
    found = m and (m.group(1) if fields.pattern.groups else m.group(0))
    if not found:
        raise DatasetError(f"{where}: task.answer_pattern {fields.pattern.pattern!r} does not "
                           f"match field {name!r} (ends {value[-60:]!r})")
    return found.strip()


def check_row(row: object, where: str, fields: Fields = PLAIN) -> dict:
    """Map `row` by `fields` and check it; `where` names it in errors."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    # Set only once the row is mapped, so mapping errors list the row's own fields.
    verifier = "math" if row.get("verifier") is None else row["verifier"]  # None: a table's null
    if verifier not in fields.verifiers:
        raise DatasetError(f"{where}: verifier {verifier!r} is not one of {fields.verifiers} "
                           "(reward.checkers adds more)")
    if fields.template:
        row["prompt"] = _prompt(row, where, fields.template)
    if verifier == "code":
        try:
            row["answer"] = json.dumps(check_tests(row.get("tests")))
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from e
    else:
        row["answer"] = _answer(row, where, fields)
    for key in ("prompt", "answer"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise DatasetError(f"{where}: field {key!r} must be a non-empty string")
    row["verifier"] = verifier
    if row.get("uid") is None:
        row["uid"] = where
    return row


def read_prompts(spec: str | Path, fields: Fields = PLAIN) -> list[dict]:
    """Checked rows of a dataset path: a file, a directory or a glob (sources.resolve)."""
    return [check_row(row, where, fields) for where, row in read_rows(spec)]


def embedded_rows(seed: int, n: int, task) -> list[dict]:
    """`n` rows of the embedded task `task.embedded` from `seed` (train and eval seeds
    differ); `task.prompt_template` wraps each prompt (a chat model's user turn:
    conf/quickstart_bpe.yaml)."""
    if task.embedded == "tool_arith":
        split = tool_arith.make_split(seed, n)
    elif task.embedded == "chain_arith":
        split = chains.make_split(seed, n, task.chain_median_steps, task.chain_sigma,
                                  task.chain_max_steps)
    else:
        split = arith.make_split(seed, n, task.max_steps_per_problem, p_stop=task.chain_p_stop)
    uids = [f"{task.embedded}-{seed}-{i}" for i in range(len(split))]
    if task.embedded == "chain_arith":
        rows = [chains.to_row(p, uid) for p, uid in zip(split, uids)]
    else:
        rows = [p.to_row(uid) for p, uid in zip(split, uids)]
    for r in rows if task.prompt_template else []:
        r["prompt"] = _prompt(r, r["uid"], task.prompt_template)
    return rows


def train_stream(task, n_needed: int, verifiers: tuple[str, ...] = BUILT_IN):
    """The stream of the `n_needed` prompts training consumes, in training order;
    `verifiers`: the names its rows may give (registry.verifier_names)."""
    from areal_ray.data.stream import file_stream, rows_stream  # ray.data: not for config checks
    if not task.train_path:
        return rows_stream(embedded_rows(EMBEDDED_TRAIN_SEED + task.seed, n_needed, task))
    return file_stream(task.train_path, n_needed, task.seed, task.shuffle_window,
                       Fields.of(task, verifiers), task.max_row_bytes)


def train_rows(task, n_needed: int) -> list[dict]:
    """Exactly `n_needed` prompts, in training order, in this process (a peer fed the
    same prompts; tests). Each row has its stream position `pos`."""
    return list(train_stream(task, n_needed))


def eval_rows(task, verifiers: tuple[str, ...] = BUILT_IN) -> list[dict]:
    if not task.eval_path:
        return embedded_rows(EMBEDDED_EVAL_SEED + task.seed, task.n_eval, task)
    fields = Fields.of(task, verifiers)
    rows = [check_row(row, where, fields)
            for where, row in islice(iter_rows(task.eval_path, task.max_row_bytes), task.n_eval)]
    if not rows:
        raise DatasetError(f"{task.eval_path}: no rows")
    return rows
