"""Dataset rows are checked up front; a bad row is an error naming file and line."""

import json

import pytest

from areal_ray.config import load_config
from areal_ray.data.prompts import DatasetError, read_jsonl, train_rows


def write(tmp_path, rows):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_math_and_code_rows(tmp_path):
    tests = [{"input": "1\n", "output": "1\n"}]
    rows = read_jsonl(write(tmp_path, [{"prompt": "1+1=", "answer": "2"},
                                       {"prompt": "echo", "verifier": "code", "tests": tests}]))
    assert rows[0]["verifier"] == "math"
    assert json.loads(rows[1]["answer"]) == tests


@pytest.mark.parametrize("bad,match", [
    ('{"prompt": "x"', "d.jsonl:2: not valid JSON"),
    ({"prompt": "x"}, "d.jsonl:2: field 'answer'"),
    ({"prompt": "x", "answer": "1", "verifier": "llm"}, "verifier 'llm'"),
    ({"prompt": "x", "verifier": "code", "tests": []}, "d.jsonl:2: tests must be"),
    ({"prompt": "x", "verifier": "code", "tests": [{"input": 1, "output": "1"}]}, "test 0"),
])
def test_bad_rows_are_clear_errors(tmp_path, bad, match):
    with pytest.raises(DatasetError, match=match):
        read_jsonl(write(tmp_path, [{"prompt": "ok", "answer": "1"}, bad]))


def test_train_rows_cycle_epochs_each_prompt_once_per_epoch(tmp_path):
    p = write(tmp_path, [{"uid": f"u{i}", "prompt": str(i), "answer": str(i)} for i in range(5)])
    cfg = load_config(None, [f"task.train_path={p}"])
    rows = train_rows(cfg.task, 12)
    assert len(rows) == 12
    for epoch in (0, 1):
        assert sorted(r["uid"] for r in rows[5 * epoch: 5 * epoch + 5]) == [f"u{i}" for i in range(5)]
