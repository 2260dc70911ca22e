from transformers import AutoTokenizer

from areal_ray.task.arith import make_split


def test_char_tokenizer_roundtrips_through_auto_tokenizer(random_model_dir):
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    for p in make_split(seed=3, n=50):
        text = p.prompt + p.solution
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tok.decode(ids) == text
    assert tok.eos_token_id is not None and tok.pad_token_id is not None


def test_every_character_survives_auto_tokenizer_of_a_qwen2_model(random_model_dir):
    """transformers loads a qwen2 model's tokenizer as Qwen2Tokenizer (byte-level), which
    drops characters its vocabulary lacks: newline and space must be there by their
    byte-level names, and the tokenizer the warm start trains with must agree."""
    from areal_ray.task.tokenizer import ALPHABET, build_char_tokenizer

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    ours = build_char_tokenizer()
    text = ALPHABET + "calc(4821+3907)=8728\n\\boxed{8728}  a b\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == ours(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == ours.decode(ids) == text
