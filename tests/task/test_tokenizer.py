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
    """transformers' AutoTokenizer swaps in a Qwen2Tokenizer for a qwen2 model dir:
    load_tokenizer keeps the tokenizer the dir names. The Qwen2Tokenizer's byte-level
    pre-tokenizer would drop a space or a newline the vocabulary names as itself; the
    vocabulary names them `Ġ` and `Ċ`, so it agrees too (a reader we do not control,
    e.g. an engine's own AutoTokenizer, sees the same ids)."""
    from areal_ray.task.tokenizer import build_char_tokenizer

    text = ALPHABET + "calc(4821+3907)=8728\n\\boxed{8728}  a b\n"
    ours = build_char_tokenizer()
    want = ours(text, add_special_tokens=False)["input_ids"]
    assert len(want) == len(text) and ours.decode(want) == text
    for tok in (load_tokenizer(random_model_dir), AutoTokenizer.from_pretrained(random_model_dir)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == want and tok.decode(ids) == text, type(tok).__name__
