"""A character-level tokenizer for the embedded task, built with HF `tokenizers`.

Every character of the task's alphabet is one token, so the tiny model never has to
learn sub-word splits of numbers. It is saved as a `PreTrainedTokenizerFast` and
loaded back with `load_tokenizer` (below: the class the directory names).

`AutoTokenizer` (transformers 5), which readers we do not control may use, loads a
`qwen2` model's tokenizer as `Qwen2Tokenizer` whatever tokenizer_config.json names:
our vocabulary in a BPE model without merges (one token per character: the same ids),
behind Qwen2's byte-level pre-tokenizer and decoder, which write a space as `Ġ` and a
newline as `Ċ`, and which silently drop a character the vocabulary does not hold. So
the vocabulary names every character by its byte-level form (BYTE_LEVEL), and this
tokenizer is byte-level too: both encode and decode every character of the alphabet
alike (tests/task/test_tokenizer.py). (Before this, `\n` and ` ` were dropped by the
AutoTokenizer-loaded tokenizer; the arithmetic task uses neither, and artifacts/tiny
keeps its own tokenizer files.)

Its chat template concatenates the messages' contents in order, with no role markers:
a chat agent (deployments/openai_api.py) then produces exactly the token stream of a
completion-style multi-turn workflow (prompt, model text, tool result, model text...).

The `hermes` variant (CHAR_TOKENIZERS; artifacts/tiny-agents) is for agents that send
`tools=` and read `tool_calls`: its alphabet adds what JSON needs (`"`, `[`, `]`, after
the others, so every shared character keeps its id), and its template renders what
Hermes / Qwen2.5 models read, without their role markers: the offered tools' names in
`<tools>...</tools>`, an assistant's calls as `<tool_call>\n{"name": ..., "arguments":
...}\n</tool_call>` (arguments by `tojson`, whose spacing is `json.dumps`'s, the
spacing the warm start writes) and a tool's result as `<tool_response>\n...\n
</tool_response>\n`. Rendered turn after turn, each prompt starts with the previous
prompt + what the model wrote, which is what lets the endpoint's sessions
(areal_ray/rollout/openai/sessions.py) chain the calls without re-encoding them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

ALPHABET = "0123456789+-*=,.:;()?\\{}abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ #\n/<>_"
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}  # Ġ, Ċ: the alphabet's other characters are their own byte-level form
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
HERMES_ALPHABET = ALPHABET + '"[]'
# `{{ "\n" }}`, not a newline: the template environment trims the newline after a tag.
HERMES_CHAT_TEMPLATE = (
    '{%- if tools -%}<tools>{%- for t in tools -%}'
    '{{ t.function.name if t.function is defined else t.name }}{{ "," if not loop.last }}'
    '{%- endfor -%}</tools>{{ "\\n" }}{%- endif -%}'
    '{%- for m in messages -%}'
    '{%- if m.role == "tool" -%}<tool_response>{{ "\\n" }}{{ m.content }}{{ "\\n" }}</tool_response>{{ "\\n" }}'
    '{%- else -%}{{ m.content or "" }}'
    '{%- for c in m.tool_calls or [] -%}<tool_call>{{ "\\n" }}{"name": {{ c.function.name | tojson }}, '
    '"arguments": {{ c.function.arguments | tojson }}}{{ "\\n" }}</tool_call>{%- endfor -%}'
    '{%- endif -%}{%- endfor -%}')
# name: (alphabet, chat template)
CHAR_TOKENIZERS = {"char": (ALPHABET, CHAT_TEMPLATE), "hermes": (HERMES_ALPHABET, HERMES_CHAT_TEMPLATE)}


def build_char_tokenizer(variant: str = "char") -> PreTrainedTokenizerFast:
    if variant not in CHAR_TOKENIZERS:
        raise ValueError(f"tokenizer {variant!r} is not one of {sorted(CHAR_TOKENIZERS)}")
    alphabet, chat_template = CHAR_TOKENIZERS[variant]
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK])}
    for ch in alphabet:
        vocab.setdefault(BYTE_LEVEL.get(ch, ch), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Split(Regex("."), behavior="isolated")])
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        padding_side="left", clean_up_tokenization_spaces=False, chat_template=chat_template)


def save_char_tokenizer(path: str | Path, variant: str = "char") -> PreTrainedTokenizerFast:
    tok = build_char_tokenizer(variant)
    tok.save_pretrained(str(path))
    return tok


# The classes a tokenizer_config.json names for a plain `tokenizer.json` tokenizer.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    """The tokenizer of a model directory, as its tokenizer_config.json names it.

    `AutoTokenizer` in transformers 5 overrides the named class for some model types
    whose Hub configs are known to be wrong, qwen2 among them: it loads a
    `Qwen2Tokenizer`, whose byte-level pre-tokenizer silently drops the spaces and
    newlines of our character-level tokenizer (`"=87 28\n"` became 5 ids, not 7). A
    directory whose config names the generic class gets that class; every other
    tokenizer (a real Qwen's names `Qwen2Tokenizer`) is left to `AutoTokenizer`."""
    from transformers import AutoTokenizer
    config = Path(path, "tokenizer_config.json")
    if config.exists() and json.loads(config.read_text()).get("tokenizer_class") in GENERIC_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))
