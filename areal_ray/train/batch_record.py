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
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal_ray.train.feeder import StepBatch
from areal_ray.types import Group

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


def read_step(root: str | Path, step: int) -> tuple[dict, list[Group]]:
    path = step_path(root, step)
    if not path.exists():
        raise FileNotFoundError(f"run.replay: {path} is missing: the recorded run has "
                                f"{recorded_steps(root)} steps")
    header, *rows = path.read_text().splitlines()
    return json.loads(header), [Group.from_row({"group": r}) for r in rows]


class RecordedBatches:
    """The training loop's step source in a replay (what `StepAssembler` is otherwise)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.cursor = 0  # the ticket after the last replayed group (checkpoint state)

    def next_step(self, step: int) -> StepBatch:
        header, groups = read_step(self.root, step)
        if header["step"] != step:
            raise ValueError(f"run.replay: {step_path(self.root, step)} holds step {header['step']}")
        self.cursor = max((g.ticket for g in groups), default=self.cursor - 1) + 1
        return StepBatch(groups, list(header["rejected"]), 0.0)
