"""SFT rows: tokens and completion masks by hand on the char tokenizer, bad rows named
by file and line, the epoch order, the sft config section."""

import json

import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.data.sources import DatasetError
from areal_ray.sft.dataset import (
    SFT_TRAIN_SEED,
    as_seqs,
    encode,
    file_rows,
    load_rows,
    row_text,
    step_indices,
)
from areal_ray.task import arith
from areal_ray.task.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("artifacts/tiny")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_prompt_completion_row_trains_the_completion_and_its_eos_only(tok):
    row = encode("r", "12+7=", "12+7=19.\\boxed{19}", tok, max_len=64)
    assert row.prompt_ids == ids(tok, "12+7=")  # one token per character
    assert row.output_ids == ids(tok, "12+7=19.\\boxed{19}") + [tok.eos_token_id]
    seq = as_seqs([row])[0]
    assert len(seq["logprobs"]) == len(seq["output_ids"]) == len(seq["versions"])


def test_a_long_row_loses_its_end_and_one_left_without_a_completion_is_an_error(tok):
    row = encode("r", "12+7=", "19", tok, max_len=6)  # 5 prompt tokens + "1"; "9" and eos cut
    assert row.prompt_ids == ids(tok, "12+7=") and row.output_ids == ids(tok, "1")
    with pytest.raises(DatasetError, match=r"data.jsonl:4: no completion token is left within sft.max_len=5"):
        encode("data.jsonl:4", "12+7=", "19", tok, max_len=5)
    with pytest.raises(DatasetError, match="the prompt is empty"):
        encode("r", "", "19", tok, max_len=64)


def test_a_messages_row_renders_its_prompt_with_the_chat_template(tok):
    # the char tokenizer's template concatenates the contents (task/tokenizer.py)
    prompt, completion = row_text("r", {"messages": [{"role": "user", "content": "3+4="},
                                                     {"role": "assistant", "content": "\\boxed{7}"}]}, tok)
    assert (prompt, completion) == (tok.apply_chat_template(
        [{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True), "\\boxed{7}")
    assert prompt.endswith("3+4=")
    with pytest.raises(DatasetError, match="r: the last message must be the assistant's"):
        row_text("r", {"messages": [{"role": "user", "content": "3+4="}]}, tok)


@pytest.mark.parametrize("row,problem", [
    ({"prompt": "1+1="}, "the row has no 'completion'"),
    ({"completion": "2"}, "the row has no 'prompt'"),
    ({"prompt": "1+1=", "completion": ""}, "the completion is empty"),
    ({"prompt": "1+1=", "completion": 2}, "'completion' must be a string"),
    ([1, 2], "a row must be an object"),
    ({"messages": []}, "messages must be a non-empty list"),
])
def test_a_bad_row_is_named_by_its_file_and_line(tmp_path, tok, row, problem):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "1+1=", "completion": "2"})
    path.write_text(f"{good}\n\n{good}\n{json.dumps(row)}\n")  # the blank line counts
    with pytest.raises(DatasetError, match=f"{path}:4: {problem}"):
        file_rows(str(path), tok, 64, 1 << 20)


def test_a_line_that_is_not_json_is_named(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n{oops\n")
    with pytest.raises(DatasetError, match=f"{path}:2: not valid JSON"):
        file_rows(str(path), tok, 64, 1 << 20)


def test_a_train_file_without_eval_path_holds_out_its_last_rows(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n"
                            for i in range(5)))
    cfg = load_config("conf/sft.yaml", [f"sft.train_path={path}", "sft.n_eval=2"])
    train, held = load_rows(cfg, tok)
    assert [r.where for r in train] == [f"{path}:{i}" for i in (1, 2, 3)]
    assert [r.where for r in held] == [f"{path}:{i}" for i in (4, 5)]
    cfg.sft.n_eval = 5
    with pytest.raises(DatasetError, match="would leave none to train on"):
        load_rows(cfg, tok)


def test_the_embedded_rows_are_the_arith_tasks_worked_solutions(tok):
    cfg = load_config("conf/sft.yaml", ["sft.n_train=8", "sft.n_eval=4"])
    train, held = load_rows(cfg, tok)
    problems = arith.make_split(SFT_TRAIN_SEED, 8, cfg.task.max_steps_per_problem,
                                cfg.task.chain_p_stop)
    assert len(held) == 4
    for r, p in zip(train, problems, strict=True):
        assert r.prompt_ids == ids(tok, p.prompt)
        assert r.output_ids == ids(tok, p.solution) + [tok.eos_token_id]
        assert "=" in p.solution  # worked (sft.p_direct=0), not a bare answer


def test_each_epoch_is_a_permutation_and_a_batch_may_cross_into_the_next():
    n, bs = 10, 4
    order = [i for step in range(5) for i in step_indices(n, step, bs, seed=3)]  # 2 epochs
    assert sorted(order[:10]) == sorted(order[10:]) == list(range(10))
    assert order[:10] != order[10:]  # a fresh order per epoch
    assert step_indices(n, 2, bs, seed=3) == order[8:12]  # a function of the step: resumable
    assert step_indices(n, 0, bs, seed=4) != step_indices(n, 0, bs, seed=3)


def test_bad_sft_keys_are_config_errors():
    with pytest.raises(ConfigError, match="sft.bogus"):
        load_config("conf/sft.yaml", ["sft.bogus=1"])
    with pytest.raises(ConfigError, match="sft.batch_size must be >= 1"):
        load_config("conf/sft.yaml", ["sft.batch_size=0"])


def test_a_messages_row_on_the_production_tokenizer_trains_the_answer_and_its_end_of_turn():
    """Mistral's SentencePiece with ChatML (task/bpe_tokenizer.py): the prompt is the
    template's rendering up to the assistant's turn, tokenized as generation sees it, and
    the trained tokens are the answer's and the end of turn (the tokenizer's eos)."""
    from areal_ray.task.bpe_tokenizer import build_bpe_tokenizer
    bpe = build_bpe_tokenizer()
    msgs = [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "12+7=19. \\boxed{19}"}]
    prompt, completion = row_text("r", {"messages": msgs}, bpe)
    row = encode("r", prompt, completion, bpe, max_len=256)
    assert row.prompt_ids == ids(bpe, prompt)  # what the engine is sent at generation
    assert bpe.decode(row.prompt_ids).endswith("<|im_start|>assistant\n")
    assert row.output_ids[-1] == bpe.eos_token_id == bpe.convert_tokens_to_ids("<|im_end|>")
    assert bpe.decode(row.output_ids[:-1]) == msgs[-1]["content"]
