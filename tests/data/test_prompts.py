"""Dataset rows are mapped and checked up front; a bad row is an error naming file and row."""

import json

import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.data.prompts import DatasetError, eval_rows, read_prompts, train_rows, train_stream
from tests.data.test_sources import GSM8K, SOURCES, write_jsonl, write_parquet


def write(tmp_path, rows):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_math_and_code_rows(tmp_path):
    tests = [{"input": "1\n", "output": "1\n"}]
    rows = read_prompts(write(tmp_path, [{"prompt": "1+1=", "answer": "2"},
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
        read_prompts(write(tmp_path, [{"prompt": "ok", "answer": "1"}, bad]))


def test_a_verifier_of_reward_checkers_is_a_row_only_where_it_is_known(tmp_path):
    """Rows may name the extra checkers' verifiers that the job passes in
    (reward.checkers, areal_ray/reward/registry.py); without them it is an error."""
    p = write(tmp_path, [{"prompt": "x", "answer": "3", "verifier": "length"}])
    cfg = load_config(None, [f"task.train_path={p}", f"task.eval_path={p}"])
    with pytest.raises(DatasetError, match=r"verifier 'length' is not one of \('math', 'code', 'chain'\) "
                                           r"\(reward.checkers adds more\)"):
        eval_rows(cfg.task)
    names = ("code", "length", "math")
    assert [r["verifier"] for r in eval_rows(cfg.task, names)] == ["length"]
    assert [r["answer"] for r in train_stream(cfg.task, 2, names)] == ["3", "3"]


def test_train_rows_cycle_epochs_each_prompt_once_per_epoch(tmp_path):
    p = write(tmp_path, [{"uid": f"u{i}", "prompt": str(i), "answer": str(i)} for i in range(5)])
    cfg = load_config(None, [f"task.train_path={p}"])
    rows = train_rows(cfg.task, 12)
    assert len(rows) == 12
    for epoch in (0, 1):
        assert sorted(r["uid"] for r in rows[5 * epoch: 5 * epoch + 5]) == [f"u{i}" for i in range(5)]


TEMPLATE = "Question: {question}\nAnswer: let's think step by step."
# Override values are parsed as YAML: a JSON string is a valid YAML double-quoted one.
GSM8K_KEYS = [f"task.prompt_template={json.dumps(TEMPLATE)}", r"task.answer_pattern='####\s*(.+)$'"]


def gsm8k_task(train, *more):
    return load_config(None, [f"task.train_path={train}", f"task.eval_path={train}", *GSM8K_KEYS, *more]).task


@pytest.mark.parametrize("kind", SOURCES)
def test_gsm8k_rows_map_without_conversion(tmp_path, kind):
    task = gsm8k_task(SOURCES[kind](tmp_path), "task.n_eval=2")
    rows = eval_rows(task)
    assert [r["prompt"] for r in rows] == [TEMPLATE.format(question=g["question"]) for g in GSM8K[:2]]
    assert [r["answer"] for r in rows] == ["7", "72"]
    assert all(r["verifier"] == "math" and r["uid"] and r["question"] for r in rows)
    assert sorted(r["answer"] for r in train_rows(task, 3)) == ["25", "7", "72"]


def test_plain_rows_are_unchanged_by_default(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [{"prompt": "1+1=", "answer": "2", "uid": "a"}])
    assert eval_rows(load_config(None, [f"task.eval_path={p}"]).task) == [
        {"prompt": "1+1=", "answer": "2", "uid": "a", "verifier": "math"}]


def test_answer_field_and_whole_match(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [{"problem": "6*7?", "solution": 42}])
    task = load_config(None, [f"task.eval_path={p}", "task.prompt_template='{problem}'",
                              "task.answer_field=solution"]).task
    assert [(r["prompt"], r["answer"]) for r in eval_rows(task)] == [("6*7?", "42")]
    task = load_config(None, [f"task.eval_path={p}", "task.prompt_template='{problem}'",
                              "task.answer_field=solution", r"task.answer_pattern='\d$'"]).task
    assert eval_rows(task)[0]["answer"] == "2"


def test_code_rows_ignore_the_answer_mapping(tmp_path):
    tests = [{"input": "1\n", "output": "1\n"}]
    p = write_parquet(tmp_path / "c.parquet", [{"statement": "echo", "verifier": "code", "tests": tests}])
    (row,) = eval_rows(gsm8k_task(p, "task.prompt_template='{statement}'"))
    assert row["prompt"] == "echo" and json.loads(row["answer"]) == tests


@pytest.mark.parametrize("row,keys,match", [
    ({"question": "q", "answer": "no marker"}, [],
     r"d.jsonl:2: task.answer_pattern .* does not match field 'answer' \(ends 'no marker'\)"),
    ({"query": "q", "answer": "#### 1"}, [], r"d.jsonl:2: task.prompt_template needs field 'question'; the row has \['answer', 'query'\]"),
    ({"question": "q", "final": "#### 1"}, [], r"d.jsonl:2: field 'answer' is missing \(task.answer_field\)"),
    ({"question": "q", "answer": None}, [], r"d.jsonl:2: field 'answer' is missing"),
    ({"question": "q", "answer": "#### 1"}, ["task.prompt_template='{question.x}'"],
     "d.jsonl:1: task.prompt_template cannot be filled from this row .*no attribute 'x'"),
    ({"question": "", "answer": "#### 1"}, ["task.prompt_template='{question}'"], "d.jsonl:2: field 'prompt' must be a non-empty string"),
])
def test_rows_the_mapping_cannot_use_are_clear_errors(tmp_path, row, keys, match):
    p = write_jsonl(tmp_path / "d.jsonl", [GSM8K[0], row])
    with pytest.raises(DatasetError, match=match):
        eval_rows(gsm8k_task(p, *keys))


def test_a_parquet_row_error_names_file_and_row(tmp_path):
    p = write_parquet(tmp_path / "d.parquet", [GSM8K[0], {"question": "q", "answer": "no marker"}])
    with pytest.raises(DatasetError, match=r"d.parquet\[row 1\]: task.answer_pattern"):
        train_rows(gsm8k_task(p), 4)


@pytest.mark.parametrize("keys,match", [
    (["task.prompt_template='Q: {question'"], "task.prompt_template: .*brace"),
    (["task.prompt_template='Q: {}'"], "task.prompt_template: fields must be named"),
    (["task.prompt_template='Q: {0}'"], "task.prompt_template: fields must be named"),
    (["task.answer_pattern='(unclosed'"], "task.answer_pattern: not a valid regex"),
    (["task.answer_field=''"], "task.answer_field must name"),
])
def test_a_bad_template_or_pattern_is_a_config_error(tmp_path, keys, match):
    p = write_jsonl(tmp_path / "d.jsonl", GSM8K)
    with pytest.raises(ConfigError, match=match):
        eval_rows(load_config(None, [f"task.eval_path={p}", *keys]).task)


@pytest.mark.parametrize("p_stop", [0.35, 0.1])
def test_embedded_chain_lengths_follow_chain_p_stop(p_stop):
    cfg = load_config(None, [f"task.chain_p_stop={p_stop}", "task.max_steps_per_problem=32"])
    steps = [r["n_steps"] for r in train_rows(cfg.task, 2000)]
    # 1 + Geometric(p): mean 1/p, capped at 32
    assert sum(steps) / len(steps) == pytest.approx(1 / p_stop, rel=0.15)
    assert max(steps) <= 32


def test_task_embedded_picks_the_chain_task_with_its_verifier_and_lengths():
    task = load_config("conf/longtail.yaml", ["task.n_eval=20", "task.chain_max_steps=12"]).task
    train, held_out = train_rows(task, 300), eval_rows(task)
    for row in train + held_out:
        assert row["verifier"] == "chain" and row["uid"].startswith("chain_arith-")
        assert int(row["answer"]) == eval(row["prompt"][:-1])  # noqa: S307
        assert 1 <= row["n_steps"] <= 12
    assert max(r["n_steps"] for r in train) == 12 and len(held_out) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_task_embedded_picks_the_tool_task_for_train_and_eval():
    task = load_config("conf/tools.yaml", ["task.n_eval=20"]).task
    train, held_out = train_rows(task, 50), eval_rows(task)
    for row in train + held_out:
        assert row["verifier"] == "math" and row["uid"].startswith("tool_arith-")
        assert row["prompt"].endswith("=") and int(row["answer"]) == eval(row["prompt"][:-1])  # noqa: S307
    assert len(held_out) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}  # disjoint seeds
    # the default is the arithmetic chains, as before
    assert train_rows(load_config(None, []).task, 1)[0]["uid"].startswith("arith-")
