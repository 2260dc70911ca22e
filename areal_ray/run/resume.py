"""A resumed job checked against the run it continues, and the config every job keeps.

A checkpoint's consumed prompt positions name prompts only under the task settings
that made the stream, and its weights and optimizer state are one model's, trained
with one optimizer. A resume that changes what decides those (`RESUME_GUARDED` in
config/run.py) would silently train other prompts or ignore the new value, so it is
refused, naming the keys, unless `run.resume_allow_changes` lists them.

Each job of a run keeps the config it ran with, and none is overwritten: the first
job's is `config.json`, the n-th resume's `config.resume-<n>.json`. A resume is
checked against the newest of them, so a change allowed once is the baseline after.

A new run (no `run.resume`) refuses a run dir that already holds a run's outputs, as
it refuses one with checkpoints: its steps.jsonl would be appended to another run's,
and its recorded batches laid beside another run's, so that a replay of the dir would
train two runs as one (`other_run_outputs`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from areal_ray.config import ConfigError
from areal_ray.config.run import RESUME_GUARDED

FIRST_RECORD = "config.json"
_RESUME_RECORD = re.compile(r"config\.resume-(\d+)\.json")
_ABSENT = object()


def _resume_number(p: Path) -> int | None:
    m = _RESUME_RECORD.fullmatch(p.name)
    return int(m.group(1)) if m else None


def config_records(run_dir: Path) -> list[Path]:
    """The configs the run's jobs ran with, oldest first."""
    resumes = sorted((n, p) for p in run_dir.glob("config.resume-*.json")
                     if (n := _resume_number(p)) is not None)
    first = [run_dir / FIRST_RECORD] if (run_dir / FIRST_RECORD).is_file() else []
    return first + [p for _, p in resumes]


def record_path(run_dir: Path, resume: bool) -> Path:
    """Where this job's config goes: a new run's is config.json, a resume's the next
    config.resume-<n>.json."""
    if not resume:
        return run_dir / FIRST_RECORD
    n = max((_resume_number(p) or 0 for p in config_records(run_dir)), default=0)
    return run_dir / f"config.resume-{n + 1}.json"


def write_config_record(run_dir: Path, config: dict, resume: bool) -> Path:
    """This job's config, written aside and renamed, so no reader sees half of it."""
    path = record_path(run_dir, resume)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, path)
    return path


def lookup(config: dict, key: str):
    """The value of dotted `key` in nested `config`, or _ABSENT."""
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def guarded_changes(old: dict, new: dict) -> dict[str, tuple]:
    """{key: (old value, new value)} of the guarded keys that differ. A key the old
    config lacks (written before the key existed) is not a change."""
    out = {}
    for key in RESUME_GUARDED:
        a, b = lookup(old, key), lookup(new, key)
        if a is not _ABSENT and a != b:
            out[key] = (a, b)
    return out


def check_resume_config(run_dir: Path, new: dict, allowed: list[str]) -> dict[str, tuple]:
    """The guarded changes of this resume against the run's newest config record,
    once each is in `allowed`; a ConfigError naming the others."""
    records = config_records(run_dir)
    if not records:
        return {}
    last = records[-1]
    try:
        old = json.loads(last.read_text())
    except ValueError as e:
        raise ConfigError(f"run.resume: {last} is what the resume is checked against, and it is "
                          f"not valid JSON ({e}): restore it, or delete it to resume unchecked") from e
    changes = guarded_changes(old, new)
    refused = [k for k in changes if k not in allowed]
    if refused:
        what = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r} ({RESUME_GUARDED[k]})"
                         for k in refused)
        raise ConfigError(f"run.resume: the config differs from the run's ({last.name}) in what "
                          f"its checkpoints refer to: {what}. Resume with the run's values, or "
                          f"pass run.resume_allow_changes=[{','.join(refused)}]")
    return changes


STEPS_LOG = "steps.jsonl"  # the run's log (observe/tracking.py)


def other_run_outputs(run_dir: Path, batches_dir: str) -> list[str]:
    """What in `run_dir` a run already wrote (its step log, its recorded batches), by
    relative path; an empty step log (a job that ended before its first step) is not
    an output."""
    out = []
    steps = run_dir / STEPS_LOG
    if steps.is_file() and steps.stat().st_size > 0:
        out.append(STEPS_LOG)
    batches = run_dir / batches_dir
    if batches.is_dir():
        recorded = sorted(p.name for p in batches.glob("step-*.jsonl"))
        if recorded:
            out.append(f"{batches_dir}/ ({len(recorded)} recorded steps: "
                       f"{recorded[0]}{' ... ' + recorded[-1] if len(recorded) > 1 else ''})")
    return out


def check_fresh_run_dir(run_dir: Path, batches_dir: str) -> None:
    """A new run's dir holds no other run's outputs; a ConfigError naming them."""
    found = other_run_outputs(run_dir, batches_dir)
    if found:
        raise ConfigError(f"{run_dir} already holds another run's outputs ({'; '.join(found)}): "
                          "pass run.resume=true to continue that run (it needs a checkpoint), "
                          "or choose another run.run_dir")
