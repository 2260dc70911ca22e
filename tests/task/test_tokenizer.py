import pytest
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


def test_the_hermes_variant_adds_jsons_characters_and_keeps_every_id():
    """artifacts/tiny-agents starts from artifacts/tiny-tools' weights: a shared
    character must keep its id (the new ones are new rows)."""
    from areal_ray.task.tokenizer import HERMES_ALPHABET, build_char_tokenizer

    char, hermes = build_char_tokenizer(), build_char_tokenizer("hermes")
    assert set(HERMES_ALPHABET) - set(ALPHABET) == set('"[]')
    assert all(hermes.convert_tokens_to_ids(t) == i for t, i in char.get_vocab().items())
    assert len(hermes) == len(char) + 3
    text = '<tool_call>\n{"name": "calc", "arguments": {"expr": [1, 2]}}\n</tool_call>'
    ids = hermes(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and hermes.unk_token_id not in ids and hermes.decode(ids) == text
    with pytest.raises(ValueError, match="tokenizer 'bpe'"):
        build_char_tokenizer("bpe")


TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def test_the_hermes_template_renders_tools_calls_and_results_turn_after_turn():
    """Each turn's prompt starts with the previous prompt + what the model wrote (the
    endpoint's sessions chain on that), a call re-rendered from its JSON is the text the
    model writes (json.dumps' spacing), and the tools offered are named up front."""
    from areal_ray.rollout.openai.protocol import render_chat
    from areal_ray.task.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("hermes")
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12+3"}}\n</tool_call>'
    user = [{"role": "user", "content": "12+3="}]
    first = render_chat(tok, user, [TOOL])
    assert first == "<tools>calc</tools>\n12+3="
    as_text = user + [{"role": "assistant", "content": call}]
    as_json = user + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": {"expr": "12+3"}}}]}]
    result = {"role": "tool", "tool_call_id": "c", "content": "15"}
    second = render_chat(tok, as_text + [result], [TOOL])
    assert second == first + call + "<tool_response>\n15\n</tool_response>\n"
    assert render_chat(tok, as_json + [result], [TOOL]) == second
    assert render_chat(tok, user, None) == "12+3="  # no tools offered, none named
    two = [TOOL, {"type": "function", "function": {"name": "python"}}]
    assert render_chat(tok, user, two).startswith("<tools>calc,python</tools>\n")


def test_a_saved_hermes_tokenizer_loads_with_its_template(tmp_path):
    from areal_ray.task.tokenizer import save_char_tokenizer

    saved = save_char_tokenizer(tmp_path, "hermes")
    for tok in (load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)):
        assert tok.chat_template == saved.chat_template and len(tok) == len(saved)
        assert tok('{"a": [1]}', add_special_tokens=False)["input_ids"] == \
            saved('{"a": [1]}', add_special_tokens=False)["input_ids"]
