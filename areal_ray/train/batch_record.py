"""Recorded step batches: what each training step trained, written as the run goes, so
the run can be retrained on exactly the same data (`run.replay`).

An asynchronous run is not reproducible by re-running it: which samples form a step,
and which policy version generated each token, depend on timing. What it trained can
be kept instead. Rank 0 writes one file per step, `<run_dir>/batches/step-NNNNNN.jsonl`:
a header line (step, the rejected positions, the run seed and whether requests were
seeded) and one line per prompt group in training order, with every sample's prompt
and output token ids, behaviour logprobs, per-token versions, loss mask, reward and
stop reason, and the group's stream position and ticket. A sample's sampling seeds
follow from the header's seed, the position, its index in the group and its call
number (`areal_ray/rollout/seeds.py`).

`RecordedBatches` serves those files to the training loop in place of the pipeline:
the same groups in the same order, so on CPU the replayed steps are bit-identical to
the recorded ones, and a change to the objective (`algo.*`) is compared on exactly the
same data. Files are written to a temporary name and renamed, so a crash never leaves
a half-written step behind.

A step file is read as untrusted input: an edited or damaged one would otherwise
train in silence on what it says (a logprob list shorter than the output broadcast
over it, a NaN logprob, an infinite reward, a token id no embedding has). Each is
checked on read (`group_problem`), and a bad one is a `ReplayError` naming the file
and line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from areal_ray.train.feeder import StepBatch
from areal_ray.types import Group, Sample

RECORD_DIR = "batches"


def step_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}.jsonl"


def recorded_steps(root: str | Path) -> int:
    """How many consecutive steps from step 0 `root` holds."""
    n = 0
    while step_path(root, n).exists():
        n += 1
    return n


class BatchRecorder:
    def __init__(self, root: str | Path, seed: int | None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.seed = seed

    def write(self, step: int, batch: StepBatch) -> Path:
        header = {"step": step, "groups": len(batch.groups), "rejected": list(batch.rejected),
                  "seed": self.seed, "seeded": self.seed is not None}
        lines = [json.dumps(header)] + [g.to_row()["group"] for g in batch.groups]
        path = step_path(self.root, step)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, path)
        return path


class ReplayError(ValueError):
    pass


def _token_problem(ids: list, what: str, vocab_size: int) -> str | None:
    for k, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size and t >= vocab_size):
            return (f"{what} token {k} is {t!r}, not a token id of the model's vocabulary "
                    f"(0 to {vocab_size - 1})" if vocab_size else f"{what} token {k} is {t!r}, not a token id")
    return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sample_problem(s: Sample, vocab_size: int = 0) -> str | None:
    """What makes a recorded sample untrainable as it stands, or None. `vocab_size`:
    the model's (0: ids are only checked to be non-negative integers)."""
    n = len(s.output_ids)
    for name, values in (("logprobs", s.logprobs), ("versions", s.versions),
                         ("loss_mask", s.loss_mask)):
        if values is not None and len(values) != n:
            return f"{len(values)} {name} for {n} output tokens"
    for where, ids in (("prompt", s.prompt_ids), ("output", s.output_ids)):
        if (why := _token_problem(ids, where, vocab_size)) is not None:
            return why
    bad = next((k for k, lp in enumerate(s.logprobs) if not _finite(lp)), None)
    if bad is not None:
        return f"logprob {bad} is {s.logprobs[bad]!r}, not a finite number"
    if not _finite(s.reward):
        return f"its reward is {s.reward!r}, not a finite number"
    return None


def group_problem(g: Group, vocab_size: int = 0) -> str | None:
    for j, s in enumerate(g.samples):
        if (why := sample_problem(s, vocab_size)) is not None:
            return f"group {g.uid!r} (ticket {g.ticket}), sample {j}: {why}"
    return None


def _header(path: Path, line: str) -> dict:
    try:
        header = json.loads(line)
        if not isinstance(header, dict):
            raise TypeError(f"a {type(header).__name__}")
        n, rejected = int(header["groups"]), list(header["rejected"])
        int(header["step"])
    except (ValueError, TypeError, KeyError) as e:
        raise ReplayError(f"run.replay: {path}:1: not a step header ({type(e).__name__}: {e})") from e
    if n < 0 or not all(isinstance(p, int) for p in rejected):
        raise ReplayError(f"run.replay: {path}:1: not a step header (groups {n}, rejected {rejected!r})")
    return header


def read_step(root: str | Path, step: int, vocab_size: int = 0) -> tuple[dict, list[Group]]:
    """A recorded step's header and groups, each checked (`group_problem`)."""
    path = step_path(root, step)
    if not path.exists():
        raise FileNotFoundError(f"run.replay: {path} is missing: the recorded run has "
                                f"{recorded_steps(root)} steps")
    lines = path.read_text().splitlines()
    if not lines:
        raise ReplayError(f"run.replay: {path} is empty")
    header, rows = _header(path, lines[0]), lines[1:]
    if header["groups"] != len(rows):
        raise ReplayError(f"run.replay: {path}:1: the header says {header['groups']} groups, "
                          f"the file holds {len(rows)}")
    groups = []
    for i, row in enumerate(rows, start=2):
        try:
            g = Group.from_row({"group": row})
        except (ValueError, TypeError, KeyError) as e:
            raise ReplayError(f"run.replay: {path}:{i}: not a recorded group "
                              f"({type(e).__name__}: {e})") from e
        if (why := group_problem(g, vocab_size)) is not None:
            raise ReplayError(f"run.replay: {path}:{i}: {why}")
        groups.append(g)
    return header, groups


class RecordedBatches:
    """The training loop's step source in a replay (what `StepAssembler` is otherwise);
    `vocab_size`: the trained model's, which every recorded token id must be within."""

    def __init__(self, root: str | Path, vocab_size: int = 0):
        self.root = Path(root)
        self.vocab_size = vocab_size
        self.cursor = 0  # the ticket after the last replayed group (checkpoint state)

    def next_step(self, step: int) -> StepBatch:
        header, groups = read_step(self.root, step, self.vocab_size)
        if header["step"] != step:
            raise ValueError(f"run.replay: {step_path(self.root, step)} holds step {header['step']}")
        self.cursor = max((g.ticket for g in groups), default=self.cursor - 1) + 1
        return StepBatch(groups, list(header["rejected"]), 0.0)
