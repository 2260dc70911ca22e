"""A replayed step is checked as it is read (`run.replay`): a tampered or damaged step
file is an error naming the file and line, never trained in silence."""

import json

import pytest

from areal_ray.train.batch_record import BatchRecorder, RecordedBatches, ReplayError, step_path
from areal_ray.train.feeder import StepBatch
from areal_ray.types import Group, Sample

VOCAB = 64


def group(ticket: int) -> Group:
    samples = [Sample([5, 6, 7], [8, 9, 10], [-0.5, -0.25, -1.0], [0, 0, 0], "stop", reward=r)
               for r in (1.0, 0.0)]
    return Group(ticket, f"u{ticket}", "1+2=", "3", "math", 0, samples, pos=ticket)


@pytest.fixture
def recorded(tmp_path):
    root = tmp_path / "batches"
    BatchRecorder(root, seed=7).write(0, StepBatch([group(0), group(1)], [5], 0.0))
    return root


def tamper(root, line: int, edit) -> None:
    """Rewrite 1-based `line` of step 0's file as `edit(parsed line)` returns it."""
    path = step_path(root, 0)
    lines = path.read_text().splitlines()
    lines[line - 1] = json.dumps(edit(json.loads(lines[line - 1])))
    path.write_text("\n".join(lines) + "\n")


def sample0(edit):
    def apply(g):
        edit(g["samples"][0])
        return g
    return apply


def test_an_untouched_step_replays_as_recorded(recorded):
    batch = RecordedBatches(recorded, VOCAB).next_step(0)
    assert [g.ticket for g in batch.groups] == [0, 1] and batch.rejected == [5]
    assert batch.groups[0].samples[0].logprobs == [-0.5, -0.25, -1.0]


@pytest.mark.parametrize("line, edit, match", [
    # the header says 8 groups, the file holds 2
    (1, lambda h: {**h, "groups": 8}, r":1: the header says 8 groups, the file holds 2"),
    (1, lambda h: {k: v for k, v in h.items() if k != "rejected"}, r":1: not a step header"),
    # logprobs shorter than the output: would be broadcast over it
    (2, sample0(lambda s: s.update(logprobs=[-0.5])), r":2: group 'u0' \(ticket 0\), sample 0: "
                                                       r"1 logprobs for 3 output tokens"),
    (3, sample0(lambda s: s.update(versions=[0, 0])), r":3: .*2 versions for 3 output tokens"),
    (2, sample0(lambda s: s.update(loss_mask=[1])), r":2: .*1 loss_mask for 3 output tokens"),
    (2, sample0(lambda s: s.update(logprobs=[-0.5, float("nan"), -1.0])), r":2: .*logprob 1 is nan"),
    (2, sample0(lambda s: s.update(reward=float("inf"))), r":2: .*its reward is inf, not a finite"),
    (2, sample0(lambda s: s.update(reward=None)), r":2: .*its reward is None"),
    (2, sample0(lambda s: s.update(output_ids=[8, 10**9, 10])),
     r":2: .*output token 1 is 1000000000, not a token id of the model's vocabulary \(0 to 63\)"),
    (3, sample0(lambda s: s.update(prompt_ids=[5, -1, 7])), r":3: .*prompt token 1 is -1"),
    (2, sample0(lambda s: s.update(output_ids=[8, 9.5, 10])), r":2: .*output token 1 is 9.5"),
    (2, lambda g: {**g, "samples": [{"prompt_ids": [1]}]}, r":2: not a recorded group"),
])
def test_a_tampered_step_is_an_error_naming_file_and_line(recorded, line, edit, match):
    tamper(recorded, line, edit)
    with pytest.raises(ReplayError, match=r"run.replay: .*step-000000.jsonl" + match):
        RecordedBatches(recorded, VOCAB).next_step(0)


def test_a_line_that_is_not_json_is_named(recorded):
    path = step_path(recorded, 0)
    path.write_text(path.read_text().replace('"uid": "u1"', '"uid": u1', 1))
    with pytest.raises(ReplayError, match=r"step-000000.jsonl:3: not a recorded group"):
        RecordedBatches(recorded, VOCAB).next_step(0)
