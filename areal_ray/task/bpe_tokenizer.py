"""A production tokenizer for the second embedded model family: Mistral's SentencePiece.

Every other embedded model reads characters (task/tokenizer.py). Users' checkpoints do
not: their tokenizers merge sub-words, fall back to bytes for what the vocabulary
lacks, and wrap chats in special tokens, and each of those is where interrupted
generation, stop strings, tool-call tags and streamed text go wrong in practice. This
module makes a real one into a standard Hugging Face tokenizer directory
(`tokenizer.json` + `tokenizer_config.json`, read by `AutoTokenizer` and by vLLM as a
user's checkpoint is), so every path can run on it.

The vocabulary is Mistral's v3 instruct tokenizer as the `mistral_common` package ships
it (`SOURCE`: SentencePiece BPE, 32,768 ids, byte fallback, every digit its own token,
its control tokens `[INST]` ... `[TOOL_CALLS]` kept at their ids), converted by
transformers' own SentencePiece converter. No download: the file is in the venv.

The chat format is ChatML with Hermes tool calls, Qwen2.5's convention, which is what
vLLM's `hermes` parser and the agent frameworks' defaults expect:
- `<|im_start|>` and `<|im_end|>` are added as special tokens (ids 32768 and 32769);
  `<|im_end|>` ends an assistant turn, so it is the end-of-sequence token;
- offered tools are listed in the system turn, one JSON object a line between
  `<tools>` and `</tools>`;
- an assistant's calls are `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- a tool's result is a user turn holding `<tool_response>\\n...\\n</tool_response>`.
The tags are plain text here, not added tokens: in this vocabulary `<tool_call>` is
five tokens (`▁<`, `tool`, `_`, `call`, `>`), so a tag can be cut anywhere by a
stop, an interruption or a streamed chunk, the case the endpoint and the parsers must
survive (vLLM's hermes parser works on text and needs no tag tokens).
"""

from __future__ import annotations

import importlib.resources
import shutil
import tempfile
from pathlib import Path

SOURCE = "mistral_instruct_tokenizer_240323.model.v3"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# A user turn and the assistant's opening, as the chat template renders one user
# message with add_generation_prompt: the embedded tasks' prompts on this tokenizer
# (`task.prompt_template` of conf/quickstart_bpe.yaml; the special tokens are split out
# of the text by the tokenizer).
USER_TURN = IM_START + "user\n{prompt}" + IM_END + "\n" + IM_START + "assistant\n"
PAD = "</s>"  # SentencePiece's end token: never generated once the chat ends at IM_END
# `{{ "\n" }}` where a newline follows a tag: the template environment trims the
# newline after a block tag. Written for this project (ChatML turns, Hermes tools).
CHAT_TEMPLATE = (
    '{%- set sys = messages[0].content if messages and messages[0].role == "system" else none -%}'
    '{%- if sys is not none or tools -%}'
    '<|im_start|>system{{ "\\n" }}'
    '{%- if sys is not none -%}{{ sys }}{%- endif -%}'
    '{%- if tools -%}'
    '{%- if sys is not none -%}{{ "\\n\\n" }}{%- endif -%}'
    'You may call one or more functions. Their signatures are listed in <tools></tools>:'
    '{{ "\\n" }}<tools>'
    '{%- for t in tools -%}{{ "\\n" }}{{ (t.function if t.function is defined else t) | tojson }}{%- endfor -%}'
    '{{ "\\n" }}</tools>{{ "\\n\\n" }}'
    'For each call, write a JSON object with the function name and arguments in '
    '<tool_call></tool_call> tags:{{ "\\n" }}'
    '<tool_call>{{ "\\n" }}{"name": <function-name>, "arguments": <args-json-object>}{{ "\\n" }}</tool_call>'
    '{%- endif -%}'
    '<|im_end|>{{ "\\n" }}'
    '{%- endif -%}'
    '{%- for m in messages -%}'
    '{%- if m.role == "system" and loop.first -%}'
    '{%- elif m.role == "tool" -%}'
    '{%- if loop.first or loop.previtem.role != "tool" -%}<|im_start|>user{%- endif -%}'
    '{{ "\\n" }}<tool_response>{{ "\\n" }}{{ m.content }}{{ "\\n" }}</tool_response>'
    '{%- if loop.last or loop.nextitem.role != "tool" -%}<|im_end|>{{ "\\n" }}{%- endif -%}'
    '{%- else -%}'
    '<|im_start|>{{ m.role }}{{ "\\n" }}{{ m.content or "" }}'
    '{%- for c in m.tool_calls or [] -%}'
    '{%- set f = c.function if c.function is defined else c -%}'
    '{%- if not loop.first or m.content -%}{{ "\\n" }}{%- endif -%}'
    '<tool_call>{{ "\\n" }}{"name": {{ f.name | tojson }}, "arguments": '
    '{{ (f.arguments if f.arguments is string else f.arguments | tojson) }}}{{ "\\n" }}</tool_call>'
    '{%- endfor -%}'
    '<|im_end|>{{ "\\n" }}'
    '{%- endif -%}'
    '{%- endfor -%}'
    '{%- if add_generation_prompt -%}<|im_start|>assistant{{ "\\n" }}{%- endif -%}')


def source_path() -> Path:
    """The SentencePiece model `mistral_common` ships (its `data/` folder)."""
    path = Path(str(importlib.resources.files("mistral_common") / "data" / SOURCE))
    if not path.exists():
        raise FileNotFoundError(f"{path}: mistral_common no longer ships {SOURCE}; the production "
                                f"tokenizer is built from it (pip install -r requirements.txt)")
    return path


def build_bpe_tokenizer():
    """The tokenizer: `SOURCE` converted by transformers, ChatML's special tokens added,
    the chat template set. Deterministic: the same files every time."""
    from transformers import LlamaTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        # transformers converts a directory's `tokenizer.model` with its SentencePiece
        # converter (byte fallback, the model's normalizer) into a `tokenizers` tokenizer
        shutil.copy(source_path(), Path(tmp, "tokenizer.model"))
        tok = LlamaTokenizer.from_pretrained(tmp)
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.eos_token, tok.pad_token = IM_END, PAD
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_bpe_tokenizer(path: str | Path):
    tok = build_bpe_tokenizer()
    tok.save_pretrained(str(path))
    return tok
