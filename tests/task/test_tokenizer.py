from transformers import AutoTokenizer

from areal_ray.task.arith import make_split
from areal_ray.task.tokenizer import ALPHABET, load_tokenizer


def test_char_tokenizer_roundtrips_through_load_tokenizer(random_model_dir):
    tok = load_tokenizer(random_model_dir)
    for p in make_split(seed=3, n=50):
        text = p.prompt + p.solution
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    assert tok.eos_token_id is not None and tok.pad_token_id is not None


def test_every_character_of_the_alphabet_is_one_token_spaces_and_newlines_too(random_model_dir):
    """transformers' AutoTokenizer swaps in a Qwen2Tokenizer for a qwen2 model dir and
    drops spaces and newlines: load_tokenizer keeps the tokenizer the dir names."""
    tok = load_tokenizer(random_model_dir)
    ids = tok(ALPHABET, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(ALPHABET) and tok.decode(ids) == ALPHABET
    auto = AutoTokenizer.from_pretrained(random_model_dir)
    if type(auto).__name__ == "Qwen2Tokenizer":  # the override this works around
        assert len(auto(" \n", add_special_tokens=False)["input_ids"]) < 2
