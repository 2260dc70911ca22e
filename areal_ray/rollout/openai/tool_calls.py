"""Structured tool calling on the OpenAI endpoint: `tools=` in, `tool_calls` out, and
the history sent back continuing the recorded tokens.

Parsing is vLLM's (`vllm.tool_parsers`, installed with the engines): a parser per model
family, chosen by `rollout.openai.tool_parser` (`hermes`: Qwen2.5 / Qwen3 / Hermes,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). It works on the decoded
text, so it needs no special tokens in the vocabulary. We call its non-streaming
`extract_tool_calls` on the finished output only: the endpoint's generation returns
whole, and one parse is one truth for the answer and for its streamed chunks (vLLM's
streaming parser re-derives the arguments from the raw text, which differs from the
non-streamed `json.dumps` whenever the model's JSON spacing does; sse.py cuts the
parsed answer into chunks instead).

The training invariant is what matters here: the tokens the model produced are what
trains. An agent sends a call back as an assistant message with `tool_calls`, and a
chat template re-renders it from the parsed JSON (Qwen's: `tojson` of the arguments),
which is the generated text only when the model happened to write the template's
exact spacing and key order; our embedded char template drops `tool_calls`
altogether. Either way the prompt would stop extending the recorded text, and the
session would start a new trajectory from re-encoded tokens. So a call's id names the
recorded call that produced it (`call_<call index>_<j>_<digest of its output ids>_<random>`;
the digest makes sure it is that call, in the session as it is now), and an assistant
message carrying our ids is rendered from that call's generated text
(`replay_messages`), exactly as a plain-content assistant message is: the rendered
prompt extends the recorded text and the session reuses its ids (sessions.py). An
assistant message with ids we did not issue goes to the template as it is
(arguments as objects, as templates expect): it renders, but the chain only holds
when the template reproduces the model's text.

`tool_choice`: `auto` (parse) and `none` (tools still rendered, nothing parsed);
`required` and a named function would need constrained decoding, which our engines do
not do: a 400 names them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import logging
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from areal_ray.rollout.openai.protocol import bad

NONE = "none"
ID_RE = re.compile(r"^call_(\d+)_(\d+)_([0-9a-f]{12})_[0-9a-f]+$")


def known_tool_parsers() -> list[str] | None:
    """The names vLLM's parser registry knows, read from its source without importing
    vLLM (the config check runs where torch must not be imported); None when vLLM is
    not installed or the registry is not where this version of vLLM keeps it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    init = Path(next(iter(spec.submodule_search_locations)), "tool_parsers", "__init__.py")
    try:
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    getattr(t, "id", None) == "_TOOL_PARSERS_TO_REGISTER" for t in node.targets):
                return sorted(ast.literal_eval(k) for k in node.value.keys)
    except (OSError, SyntaxError, ValueError):
        return None
    return None


def check_tool_parser_name(name: str) -> None:
    """A ValueError naming the choices when `name` is neither `none` nor a parser vLLM
    registers."""
    if name == NONE:
        return
    names = known_tool_parsers()
    if names is None:
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"rollout.openai.tool_parser={name!r} needs vllm installed "
                             "(its tool parsers); set it to 'none' to turn tool calling off")
        return  # an unknown vLLM layout: the endpoint's constructor checks against the registry
    if name not in names:
        raise ValueError(f"rollout.openai.tool_parser={name!r} is not one of vLLM's tool "
                         f"parsers: none, {', '.join(names)}")


def output_digest(output_ids: list[int]) -> str:
    return hashlib.blake2s(",".join(map(str, output_ids)).encode(), digest_size=6).hexdigest()


def new_call_id(call_index: int, j: int, output_ids: list[int]) -> str:
    """The id of call `j` in the output of the session's call `call_index`."""
    return f"call_{call_index}_{j}_{output_digest(output_ids)}_{uuid.uuid4().hex[:8]}"


def call_ref(tool_call_id) -> tuple[int, str] | None:
    """(call index, output digest) of an id `new_call_id` made; None for another id."""
    m = ID_RE.match(tool_call_id) if isinstance(tool_call_id, str) else None
    return (int(m.group(1)), m.group(3)) if m else None


def _arguments_as_object(tool_call: dict) -> dict:
    """A call as chat templates read it: `arguments` an object, not OpenAI's JSON string
    (what transformers' templates and vLLM's renderer expect)."""
    fn = dict(tool_call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the string
    return {**tool_call, "function": fn}


def replay_messages(messages: list[dict], generated_text) -> list[dict]:
    """`messages` with every assistant message whose tool call ids name a recorded call
    replaced by that call's generated text (`generated_text(index, digest)`: the text
    the client was shown, or None when the session has no such call, or one whose
    output ids do not match the digest): see the module docstring. Other messages with
    tool calls get their arguments as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            refs = {call_ref(c.get("id")) if isinstance(c, dict) else None for c in calls}
            text = generated_text(*refs.pop()) if len(refs) == 1 and None not in refs else None
            if text is not None:
                out.append({"role": "assistant", "content": text})
                continue
            m = {**m, "tool_calls": [_arguments_as_object(c) if isinstance(c, dict) else c
                                     for c in calls]}
        out.append(m)
    return out


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict]  # OpenAI's shape: {id, type: function, function: {name, arguments}}


class OneLineParseErrors(logging.Filter):
    """A sampled call that is not valid JSON is the policy's output, not a fault: vLLM's
    parsers log it with `logger.exception` (a 10-line traceback each time; 285 in a
    40-step run of conf/agents_sdk.yaml) and return the text as content, which is the
    answer we want. This keeps the parser's line and drops the traceback; `seen` counts
    them for the replica's log."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.levelno >= logging.ERROR:
            self.seen += 1
            what = record.exc_info[1]
            record.msg = (f"{record.getMessage()} ({type(what).__name__}: {what}; the text is "
                          f"returned as content; {self.seen} so far in this process)")
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class ToolCallParser:
    """One of vLLM's tool parsers by registry name, on our tokenizer. vLLM is imported on
    the first request with tools (seconds, and memory, that an endpoint whose agents
    never send `tools` does not pay), in the endpoint's replica, never where the config
    is checked (the name is checked there against the registry's source)."""

    def __init__(self, name: str, tokenizer):
        self.name, self.tokenizer = name, tokenizer
        self._cls = None

    @property
    def parser_cls(self):
        if self._cls is None:
            from vllm.tool_parsers import ToolParserManager
            try:
                cls = ToolParserManager.get_tool_parser(self.name)
            except KeyError:
                raise ValueError(f"rollout.openai.tool_parser={self.name!r} is not one of vLLM's tool "
                                 f"parsers: none, {', '.join(ToolParserManager.list_registered())}") from None
            cls(self.tokenizer)  # one that cannot work with this tokenizer says so now
            quiet(logging.getLogger(cls.__module__))
            self._cls = cls
        return self._cls

    def request(self, tools: list[dict], tool_choice: str):
        """vLLM's request model for the parser (it reads `tools`, `tool_choice`); the
        tools validated by vLLM's own schema, a 400 on what it refuses."""
        from pydantic import ValidationError
        self.parser_cls  # noqa: B018 - vLLM's import, and the parser's check, before generating
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        try:
            return ChatCompletionRequest(model="-", messages=[], tools=tools, tool_choice=tool_choice)
        except ValidationError as e:
            raise bad(f"tools: {e.errors()[0].get('msg', e)}", "tools") from e

    def parse(self, text: str, request, call_index: int, output_ids: list[int]) -> Parsed:
        """The calls in `text` (the finished output `output_ids`, the session's call
        `call_index`), with ids naming that call."""
        got = self.parser_cls(self.tokenizer).extract_tool_calls(text, request)
        if not got.tools_called:
            return Parsed(text, [])
        calls = [{"id": new_call_id(call_index, j, output_ids), "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for j, c in enumerate(got.tool_calls)]
        return Parsed(got.content or None, calls)


def quiet(logger: logging.Logger) -> OneLineParseErrors:
    """`logger` with one OneLineParseErrors filter (installed once per process)."""
    for f in logger.filters:
        if isinstance(f, OneLineParseErrors):
            return f
    f = OneLineParseErrors()
    logger.addFilter(f)
    return f
