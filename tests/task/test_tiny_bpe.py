"""The production-tokenizer model (artifacts/tiny-bpe, tiny_model.BpeArithSpec): a Llama
model on Mistral's SentencePiece with ChatML turns, started from the char model.

Checked here without the minutes-long build: the transplant maps exactly the
characters it claims, one token each; the Llama model it makes computes the char
model's logits on the same characters; a warm-start example is encoded as the rollout
encodes its prompt (one text, the special tokens split out, no word-start marker before
the answer) and ends at the end of turn; the embedded rows wrap their prompts in the
chat template's user turn; and a small build is an ordinary, reproducible HF directory.
"""

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_ray.config.task import TaskConfig
from areal_ray.data.prompts import embedded_rows
from areal_ray.reward.math import math_reward
from areal_ray.task import arith, tiny_model
from areal_ray.task.bpe_tokenizer import IM_END, IM_START, USER_TURN, build_bpe_tokenizer
from areal_ray.task.tiny_model import ChatExample, char_rows, encode_sft, transplant
from areal_ray.task.tokenizer import BYTE_LEVEL, load_tokenizer

SP = "\u2581"  # SentencePiece's word-start marker
QUICKSTART_TEMPLATE = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"  # conf/quickstart_bpe.yaml


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


@pytest.fixture(scope="module")
def char():
    return load_tokenizer(Path(__file__).resolve().parents[2] / "artifacts" / "tiny")


def specials(bpe, char):
    return {bpe.eos_token: char.eos_token, bpe.pad_token: char.pad_token,
            bpe.bos_token: char.bos_token, bpe.unk_token: char.unk_token}


def test_char_rows_on_a_table():
    bpe = {SP: 10, "9": 11, "<0x39>": 12, "<0x0A>": 13, "ab": 14, "<|im_end|>": 15, "x": 16}
    char = {"</s>": 2, "9": 4, "\u0120": 5, "\u010a": 6, "a": 7, "x": 8}
    assert char_rows(bpe, char, {"<|im_end|>": "</s>"}) == {
        15: 2,    # the end of turn is the char model's end of text
        11: 4,    # a digit's own piece, not its byte token <0x39>
        10: 5,    # a space: the word-start marker
        13: 6,    # a newline: the byte token (no piece of its own)
        16: 8}    # "a" is only inside "ab": no row


@pytest.mark.parametrize("ch,piece", [("7", "7"), ("+", "+"), ("-", "-"), ("=", "="), ("*", "*"),
                                      ("\\", "\\"), ("{", "{"), ("}", "}"), ("(", "("), (")", ")"),
                                      ("b", "b"), ("Z", "Z"), (" ", SP), ("\n", "<0x0A>")])
def test_the_real_vocabularies_map_each_character_to_the_token_that_writes_it(bpe, char, ch, piece):
    rows = char_rows(bpe.get_vocab(), char.get_vocab(), specials(bpe, char))
    vocab = char.get_vocab()  # artifacts/tiny names a space and a newline as themselves
    cid = vocab[ch] if ch in vocab else vocab[BYTE_LEVEL[ch]]  # newer char tokenizers: byte-level
    assert [bpe.convert_ids_to_tokens(b) for b, c in rows.items() if c == cid] == [piece]
    if ch not in " \n":  # the tokenizer writes the character alone with that token
        assert bpe.convert_ids_to_tokens(bpe(IM_START + ch, add_special_tokens=False)["input_ids"])[1:] == [piece]


def test_every_char_token_has_one_row(bpe, char):
    rows = char_rows(bpe.get_vocab(), char.get_vocab(), specials(bpe, char))
    assert sorted(rows.values()) == sorted(char.get_vocab().values())  # each once: no split probability
    assert rows[bpe.eos_token_id] == char.eos_token_id and bpe.eos_token == IM_END


def test_the_transplant_computes_the_char_models_logits(bpe, char):
    init = AutoModelForCausalLM.from_pretrained(str(char.name_or_path), dtype=torch.float32)
    config = tiny_model.llama_config(tiny_model.BpeArithSpec(), bpe)
    model = transplant(init, char, bpe, config, seed=0)
    assert config.model_type == "llama" and config.vocab_size == len(bpe) == 32_770
    rows = char_rows(bpe.get_vocab(), char.get_vocab(), specials(bpe, char))
    text = "12+7-3=12+7=19,19-3=16.\\boxed{16}"
    cids = char(text, add_special_tokens=False)["input_ids"]
    to_bpe = {c: b for b, c in rows.items()}
    with torch.no_grad():
        want = init(torch.tensor([cids])).logits[0]
        got = model(torch.tensor([[to_bpe[c] for c in cids]])).logits[0]
    b, c = torch.tensor(list(rows)), torch.tensor(list(rows.values()))
    torch.testing.assert_close(got[:, b], want[:, c])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_chat_example_is_encoded_as_the_rollout_encodes_its_prompt(bpe):
    problem = arith.make_split(3, 1, 8)[0]
    ex = ChatExample.of(problem)
    assert ex.prompt == bpe.apply_chat_template([{"role": "user", "content": problem.prompt}],
                                                add_generation_prompt=True, tokenize=False)
    ids, att, labels = encode_sft(bpe, [ex])
    prompt = bpe(ex.prompt, add_special_tokens=False)["input_ids"]
    assert ids[0, : len(prompt)].tolist() == prompt and (labels[0, : len(prompt)] == -100).all()
    answer = ids[0, len(prompt):].tolist()
    assert labels[0, len(prompt):].tolist() == answer and answer[-1] == bpe.eos_token_id
    assert bpe.convert_ids_to_tokens(answer[0]) != SP  # no word start: the answer goes on the line
    # the reward reads the text before the end of turn, as the engines decode it
    assert math_reward(bpe.decode(answer, skip_special_tokens=True), problem.answer) == 1.0


def test_the_embedded_rows_are_chat_turns_with_the_template(bpe):
    plain = embedded_rows(5, 3, TaskConfig())
    rows = embedded_rows(5, 3, TaskConfig(prompt_template=QUICKSTART_TEMPLATE))
    assert QUICKSTART_TEMPLATE == USER_TURN
    for p, r in zip(plain, rows):
        assert r["prompt"] == USER_TURN.format(prompt=p["prompt"]) and r["answer"] == p["answer"]
        ids = bpe(r["prompt"], add_special_tokens=False)["input_ids"]
        assert ids.count(bpe.convert_tokens_to_ids(IM_START)) == 2 and ids.count(bpe.eos_token_id) == 1


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_small_build_is_a_standard_directory_and_reproducible(tmp_path):
    spec = tiny_model.BpeArithSpec(sft_steps=2, sft_batch_size=4, habit_max_steps=1,
                                   habit_check_every=1, habit_target_accuracy=-1.0, dev_size=4,
                                   eval_max_new_tokens=4)
    a, b = tmp_path / "a", tmp_path / "b"
    meta = tiny_model.build_tiny(a, spec, log=lambda *_: None)
    tiny_model.build_tiny(b, spec, log=lambda *_: None)
    assert digest(a / "model.safetensors") == digest(b / "model.safetensors")
    assert meta["habit_steps"] == 1 and "dev_accuracy_at_start" in meta
    tok = AutoTokenizer.from_pretrained(str(a))
    model = AutoModelForCausalLM.from_pretrained(str(a))
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == model.config.vocab_size
    assert (model.config.eos_token_id, model.config.pad_token_id, model.config.bos_token_id) == \
        (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (32_769, 2, 1)
    assert model.generation_config.eos_token_id == tok.eos_token_id
