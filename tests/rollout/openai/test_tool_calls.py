"""Structured tool calls (areal_ray/rollout/openai/tool_calls.py), without Ray: vLLM's
`hermes` parser on fixed text, the request checks, the parser name checked against
vLLM's registry, and the invariant that matters for training: an assistant message
carrying our tool calls renders back to exactly the text the model generated, so the
next request continues the recorded ids. End to end through the service with a
scripted engine whose output is a call (a fixed answer; artifacts/tiny-agents, the
model that writes calls, is tests/rollout/workflows/test_agents_sdk.py's): parse, `tool_calls` the `openai` types accept, a
`role: tool` reply that extends the same recorded Sample, streaming that assembles to
the same answer."""

import asyncio

import pytest
from openai.types.chat import ChatCompletion

import areal_ray.task.tokenizer as char_tokenizer
from areal_ray.config import ConfigError, load_config
from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.openai.protocol import APIError, Defaults, check_tools, render_chat
from areal_ray.rollout.openai.service import OpenAIService
from areal_ray.rollout.openai.sessions import SessionStore
from areal_ray.rollout.openai.sse import EventStream
from areal_ray.rollout.openai.tool_calls import (
    ToolCallParser,
    call_ref,
    check_tool_parser_name,
    known_tool_parsers,
    new_call_id,
    output_digest,
    replay_messages,
)
from tests.rollout.openai.test_sse import assemble_chat
from tests.rollout.workflows.test_base import _Method

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}]
CALL_TEXT = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    """The char tokenizer with the characters of JSON (`"`, `[`, `]`: the `hermes`
    variant's alphabet) and the plain template, which concatenates contents and drops
    `tools` and `tool_calls` (the hermes template: tests/rollout/workflows/test_agents_sdk.py)."""
    return _with_template(char_tokenizer.build_char_tokenizer("hermes"), char_tokenizer.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def hermes(tokenizer):
    parser = ToolCallParser("hermes", tokenizer)
    parser.parser_cls  # noqa: B018 - vLLM's import (seconds): once for the module
    return parser


@pytest.mark.parametrize("text,content,calls", [
    ("12+3=15", "12+3=15", []),
    ("let me add " + CALL_TEXT, "let me add ", [("calc", '{"expr": "12+3"}')]),
    (CALL_TEXT + CALL_TEXT.replace("12+3", "4*5"), None,
     [("calc", '{"expr": "12+3"}'), ("calc", '{"expr": "4*5"}')]),
    ('<tool_call>{"name":"calc","arguments":{"expr":"1"}}</tool_call>', None,
     [("calc", '{"expr": "1"}')]),  # arguments re-serialized: what the client gets
    ("<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),  # kept as text
])
def test_the_hermes_parser_finds_the_calls_in_the_text(hermes, text, content, calls):
    got = hermes.parse(text, hermes.request(TOOLS, "auto"), call_index=3, output_ids=[5, 6])
    assert got.content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got.tool_calls] == calls
    ref = (3, output_digest([5, 6]))
    assert all(call_ref(c["id"]) == ref and c["type"] == "function" for c in got.tool_calls)
    assert len({c["id"] for c in got.tool_calls}) == len(calls)


def test_parser_names_are_checked_against_vllms_registry(tokenizer):
    names = known_tool_parsers()
    assert "hermes" in names and "llama3_json" in names
    check_tool_parser_name("none")
    check_tool_parser_name("hermes")
    with pytest.raises(ValueError, match="not one of vLLM's tool parsers: none, .*hermes"):
        check_tool_parser_name("qwen")
    with pytest.raises(ConfigError, match="tool_parser='qwen'"):
        load_config(None, ["rollout.openai.enabled=true", "rollout.openai.tool_parser=qwen"])
    load_config(None, ["rollout.openai.tool_parser=qwen"])  # no endpoint: not checked
    with pytest.raises(ValueError, match="hermes"):
        ToolCallParser("qwen", tokenizer).request(TOOLS, "auto")


@pytest.mark.parametrize("tools,choice,ok", [
    (TOOLS, None, (TOOLS, "auto")), (TOOLS, "none", (TOOLS, "none")), (None, None, (None, "none")),
    ([], "auto", (None, "none")), (TOOLS, "required", "'required' and a named function"),
    (TOOLS, {"type": "function", "function": {"name": "calc"}}, "only 'auto' and 'none'"),
    ([{"type": "function"}], None, "tools must be a list"), ("calc", None, "tools must be a list"),
])
def test_tools_and_tool_choice_are_checked(tools, choice, ok):
    if isinstance(ok, tuple):
        assert check_tools(tools, choice) == ok
    else:
        with pytest.raises(APIError, match=ok):
            check_tools(tools, choice)


def test_tools_vllm_refuses_are_a_400(hermes):
    with pytest.raises(APIError, match="tools"):
        hermes.request([{"type": "function", "function": {"name": "calc", "parameters": 3}}], "auto")


# Qwen2.5's way of writing tools and calls, cut down: the tools in a system turn, a
# call re-rendered from its parsed JSON (`tojson`), tool results as user turns.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", ["char", "qwen"])
def test_a_replayed_call_renders_to_exactly_the_generated_text(tokenizer, template):
    """The next prompt starts with prompt + generated text (what sessions.py chains on)
    with our ids; re-rendered from the JSON, it does not when the model's spacing
    differs from the template's (here: no spaces), nor with the char template."""
    tok = tokenizer if template == "char" else _with_template(tokenizer, QWEN_LIKE)
    generated = 'ok <tool_call>\n{"name":"calc","arguments":{"expr":"12+3"}}\n</tool_call>'
    messages = [{"role": "user", "content": "12+3="}]
    prompt = render_chat(tok, messages, TOOLS)
    assert (template == "qwen") == ("calc" in prompt)  # the char template drops the tools
    sent_back = {"role": "assistant", "content": "ok ", "tool_calls": [
        {"id": new_call_id(0, 0, [1, 2]), "type": "function",
         "function": {"name": "calc", "arguments": '{"expr": "12+3"}'}}]}
    after = messages + [sent_back, {"role": "tool", "tool_call_id": "x", "content": "15"}]
    recorded = {(0, output_digest([1, 2])): generated}
    replayed = render_chat(tok, replay_messages(after, lambda *ref: recorded.get(ref)), TOOLS)
    assert replayed.startswith(prompt + generated)
    for other in ("call_abc", new_call_id(0, 0, [1, 3])):  # not ours; ours, another output
        foreign = [{**sent_back, "tool_calls": [{**sent_back["tool_calls"][0], "id": other}]}]
        rerendered = render_chat(tok, replay_messages(messages + foreign, lambda *ref: recorded.get(ref)),
                                 TOOLS)
        assert not rerendered.startswith(prompt + generated)


def _with_template(tokenizer, template):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


class ScriptedApp:
    """The rollout app's handle, answering each generate call with the next scripted
    text (as the char tokenizer's ids, then EOS)."""

    def __init__(self, tokenizer, outputs: list[str]):
        self.tok, self.outputs = tokenizer, list(outputs)
        self.generate_batch = _Method(self._generate_batch)

    async def _generate_batch(self, requests):
        out = self.tok(self.outputs.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [{"output_ids": out, "logprobs": [-0.5] * len(out), "versions": [7] * len(out),
                 "stop_reason": "stop"} for _ in requests]


def scripted_service(tokenizer, parser, outputs):
    return OpenAIService(tokenizer, EngineClient(ScriptedApp(tokenizer, outputs)), Defaults(200, 1.0),
                         SessionStore(16, 600), model_name="tiny", tool_parser=parser)


def asgi_app(svc, bodies: list):
    """The chat and responses routes over `svc` as an ASGI app (for agent frameworks' clients through
    httpx.ASGITransport, in this process); each request's body is appended to `bodies`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    api = FastAPI()

    async def answer(method, sid: str, request: Request):
        bodies.append(await request.json())
        try:
            got = await method(sid, bodies[-1])
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return got.response() if isinstance(got, EventStream) else JSONResponse(got)

    @api.post("/sessions/{sid}/v1/chat/completions")
    async def chat(sid: str, request: Request):
        return await answer(svc.chat, sid, request)

    @api.post("/sessions/{sid}/v1/responses")
    async def responses(sid: str, request: Request):
        return await answer(svc.responses, sid, request)
    return api


def test_a_tool_call_round_trip_is_one_recorded_sample(tokenizer, hermes):
    said = "ok " + CALL_TEXT
    svc = scripted_service(tokenizer, hermes, [said, "\\boxed{15}"])
    messages = [{"role": "user", "content": "12+3="}]
    body = {"model": "m", "messages": messages, "tools": TOOLS, "logprobs": True}
    first = ChatCompletion.model_validate(asyncio.run(svc.chat("s", body)))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "ok "
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("calc", '{"expr": "12+3"}')
    assert len(choice.logprobs.content) == len(said) + 1  # every token, the call's included

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "=15\n"}]
    second = asyncio.run(svc.chat("s", {**body, "messages": messages}))
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "\\boxed{15}"}
    calls = svc.session("s")["calls"]
    assert calls[1]["extends"] == 0
    history = calls[0]["prompt_ids"] + calls[0]["output_ids"]
    assert calls[1]["prompt_ids"][:len(history)] == history  # no token re-encoded
    (sample,) = svc.session("s")["samples"]
    n0, n1 = len(calls[0]["output_ids"]), len(calls[1]["output_ids"])
    assert sample["loss_mask"] == [1] * n0 + [0] * len("=15\n") + [1] * n1


def test_a_streamed_tool_call_assembles_to_the_non_streamed_answer(tokenizer, hermes):
    said = "ok " + CALL_TEXT
    svc = scripted_service(tokenizer, hermes, [said, said])
    body = {"model": "m", "messages": [{"role": "user", "content": "12+3="}], "tools": TOOLS,
            "logprobs": True}
    whole = asyncio.run(svc.chat("a", body))
    stream = asyncio.run(svc.chat("b", {**body, "stream": True}))
    assert isinstance(stream, EventStream)
    message, finish, entries, _ = assemble_chat(stream.chunks)
    want = whole["choices"][0]
    ids = lambda m: [c.pop("id") for c in m.get("tool_calls", [])]  # noqa: E731 - fresh per call
    assert [call_ref(i) for i in ids(message)] == [call_ref(i) for i in ids(want["message"])] \
        == [(0, output_digest(svc.session("a")["calls"][0]["output_ids"]))]
    assert message == want["message"] and finish == want["finish_reason"] == "tool_calls"
    assert entries == want["logprobs"]["content"]


def test_tool_choice_none_does_not_parse_and_no_parser_refuses_auto(tokenizer, hermes):
    said = "ok " + CALL_TEXT
    body = {"model": "m", "messages": [{"role": "user", "content": "1="}], "tools": TOOLS}
    got = asyncio.run(scripted_service(tokenizer, hermes, [said]).chat(
        "s", {**body, "tool_choice": "none"}))
    assert got["choices"][0]["message"] == {"role": "assistant", "content": said}
    with pytest.raises(APIError, match="tool_parser=none"):
        asyncio.run(scripted_service(tokenizer, None, [said]).chat("s", body))
    plain = asyncio.run(scripted_service(tokenizer, None, [said]).chat(
        "s", {**body, "tool_choice": "none"}))
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_a_malformed_call_is_one_warning_line_not_a_traceback(hermes):
    """vLLM's hermes parser logs a bad sample with logger.exception; the replica's log
    gets one line per bad sample, and the text still comes back as content."""
    import logging
    import re
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger(hermes.parser_cls.__module__)
    keep = Keep()
    logger.addHandler(keep)
    try:
        for _ in range(2):
            got = hermes.parse("<tool_call>{not json</tool_call>", hermes.request(TOOLS, "auto"),
                               call_index=0, output_ids=[1])
            assert got.content == "<tool_call>{not json</tool_call>" and not got.tool_calls
    finally:
        logger.removeHandler(keep)
    assert len(records) == 2 and all(r.exc_info is None and r.levelname == "WARNING" for r in records)
    assert "JSONDecodeError" in records[0].getMessage() and "returned as content" in records[0].getMessage()
    counts = [int(re.search(r"(\d+) so far", r.getMessage()).group(1)) for r in records]
    assert counts[1] == counts[0] + 1
