"""The production tokenizer (task/bpe_tokenizer.py): Mistral's SentencePiece from
`mistral_common`, saved as a standard HF tokenizer with ChatML and Hermes tool calls.

What is checked here is what the other paths rely on: the files are the same every
build; `AutoTokenizer` and our `load_tokenizer` read them as a user's checkpoint is
read; bytes the vocabulary lacks fall back to byte tokens (so a generation can stop
inside a character); the tool-call tags are several tokens; re-encoding decoded text
does not give back the generated ids (why an interruption must keep ids, never text);
and the chat template renders tools, calls and results so that vLLM's hermes parser
reads the calls back and each turn's prompt extends the previous one.
"""

import hashlib
import json

import pytest
from transformers import AutoTokenizer, LlamaConfig

from areal_ray.rollout.openai.tool_calls import ToolCallParser
from areal_ray.task.bpe_tokenizer import IM_END, IM_START, save_bpe_tokenizer
from areal_ray.task.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "a calculator",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "12+35"}'}}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    tok = save_bpe_tokenizer(out)
    # a model directory as a user's Llama checkpoint has it: the config names the family
    LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(bpe_dir):
    return AutoTokenizer.from_pretrained(str(bpe_dir))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_files_are_standard_and_the_same_every_build(bpe_dir, tmp_path):
    save_bpe_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert digest(bpe_dir / name) == digest(tmp_path / name), name
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "LlamaTokenizer" and config["eos_token"] == IM_END


def test_autotokenizer_and_ours_read_it_as_a_checkpoint_is_read(bpe_dir, tok):
    ours = load_tokenizer(bpe_dir)
    assert len(tok) == len(ours) == 32_770  # Mistral v3's 32,768 and ChatML's two
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [32_768, 32_769]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (32_769, 2, 1)
    assert tok.convert_ids_to_tokens([3, 5]) == ["[INST]", "[TOOL_CALLS]"]  # its control tokens
    text = "Héllo wörld: 12+35=47 ✓"
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    assert [tok.decode([i]) for i in tok.encode("1234", add_special_tokens=False)][-4:] == list("1234")


def test_what_the_vocabulary_lacks_falls_back_to_bytes_and_a_cut_id_list_decodes_to_a_partial_character(tok):
    ids = tok.encode("🦙", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok.decode(ids).strip() == "🦙"
    assert "🦙" not in tok.decode(ids[:-1]) and "\ufffd" in tok.decode(ids[:-1])  # a stream cut inside it


def test_the_tool_call_tags_are_several_tokens(tok):
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>"):
        assert len(tok.encode(tag, add_special_tokens=False)) >= 4, tag


def test_re_encoding_decoded_text_does_not_give_back_generated_ids(tok):
    """A model may write "wör" as "w" + "ör" + ... in any split: ids decoded and encoded
    again are not the ids it generated, so a resumed generation must keep the ids."""
    generated = tok.convert_tokens_to_ids(["▁w", "ö", "r", "ld"])  # a valid, unmerged split
    text = tok.decode(generated)
    assert text.strip() == "wörld"
    assert tok.encode(text, add_special_tokens=False) != generated


def test_the_chat_template_renders_tools_calls_and_results_in_hermes_chatml(tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12+35?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "47"},
            {"role": "assistant", "content": "47"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert text.startswith(f"{IM_START}system\nBe brief.\n\n") and "\n<tools>\n{" in text
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]["function"]
    assert (f"{IM_START}assistant\n<tool_call>\n"
            '{"name": "calc", "arguments": {"expr": "12+35"}}\n</tool_call>' + IM_END) in text
    assert f"{IM_START}user\n<tool_response>\n47\n</tool_response>{IM_END}\n" in text
    assert text.endswith(f"{IM_START}assistant\n47{IM_END}\n")
    # arguments given as an object (as some clients send them) render the same JSON
    as_object = [*msgs[:2], {**msgs[2], "tool_calls": [
        {**CALL, "function": {"name": "calc", "arguments": {"expr": "12+35"}}}]}, *msgs[3:]]
    assert tok.apply_chat_template(as_object, tools=TOOLS, tokenize=False) == text


def test_each_turns_prompt_extends_the_previous_prompt_and_the_models_answer(tok):
    """What lets a session chain calls on recorded tokens (rollout/openai/sessions.py):
    prompt(turn k) + the model's text + its end token starts prompt(turn k+1)."""
    history = [{"role": "user", "content": "What is 12+35?"}]
    first = tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    answer = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12+35"}}\n</tool_call>'
    history += [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "47"}]
    second = tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert second.startswith(first + answer + IM_END + "\n")


def test_vllms_hermes_parser_reads_the_calls_the_template_writes(tok):
    parser = ToolCallParser("hermes", tok)
    request = parser.request(TOOLS, "auto")
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "12+35"}}\n'
            '</tool_call>')
    got = parser.parse(text, request, 0, tok.encode(text, add_special_tokens=False))
    assert got.content.strip() == "Let me compute."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == \
        [("calc", {"expr": "12+35"})]
