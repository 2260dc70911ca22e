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
