"""Streaming answers (areal_ray/rollout/openai/sse.py), pure: chunks cut at token boundaries
that the `openai` package's chunk types accept and that assemble to exactly the
non-streamed answer, content, tool calls, logprobs and finish reason."""

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from areal_ray.rollout.openai.sse import EventStream, chat_chunks, completion_chunks, cut


@pytest.mark.parametrize("text,pieces,segments,rest", [
    ("abc", ["a", "b", "c"], [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)], 3),
    ("ab", ["a", "b", ""], [("a", 0, 1), ("b", 1, 2)], 2),  # EOS: shown as nothing, after the text
    ("ab", ["ab", "<x>", "y"], [("ab", 0, 1)], 1),  # tokens past the content (a tool call)
    ("a", ["ab"], [("a", 0, 1)], 1),  # the content ends inside a token
    ("é!", ["\ufffd", "\ufffd", "!"], [("é!", 0, 3)], 3),  # a character split across tokens
    ("", ["<x>"], [], 0),
])
def test_cut_at_token_boundaries(text, pieces, segments, rest):
    assert cut(text, pieces) == (segments, rest)


def chat(message: dict, finish: str, n_tokens: int, logprobs: bool, extra=None) -> dict:
    lp = {"content": [{"token": f"t{i}", "logprob": -i / 10, "bytes": [116], "top_logprobs": []}
                      for i in range(n_tokens)], "refusal": None} if logprobs else None
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": lp,
                         **(extra or {})}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n_tokens, "total_tokens": 3 + n_tokens}}


def assemble_chat(chunks: list[dict], index: int = 0) -> tuple[dict, str, list | None, dict | None]:
    """What a streaming client builds from the chunks of choice `index`: (message,
    finish reason, logprob entries, usage)."""
    content, calls, entries, finish, usage = None, {}, None, None, None
    for raw in chunks:
        c = ChatCompletionChunk.model_validate(raw)
        usage = raw.get("usage") or usage
        for ch in c.choices:
            if ch.index != index:
                continue
            d = ch.delta
            if d.content is not None:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                got = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                got["id"] = tc.id or got["id"]
                got["function"]["name"] += tc.function.name or ""
                got["function"]["arguments"] += tc.function.arguments or ""
            if ch.logprobs is not None:
                entries = (entries or []) + [e.model_dump() for e in ch.logprobs.content]
            finish = ch.finish_reason or finish
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, entries, usage


CALL = {"id": "call_0_0_ab", "type": "function",
        "function": {"name": "calc", "arguments": '{"expr": "1+2"}'}}


@pytest.mark.parametrize("message,finish,pieces,logprobs", [
    ({"role": "assistant", "content": "12+3"}, "stop", ["1", "2", "+", "3", ""], True),
    ({"role": "assistant", "content": "12"}, "length", ["1", "2"], False),
    ({"role": "assistant", "content": "ok ", "tool_calls": [CALL]}, "tool_calls",
     ["ok", " ", "<tool_call>", '{"name"', "...", "</tool_call>", ""], True),
    ({"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_0_1_cd"}]},
     "tool_calls", ["<tool_call>", "...", ""], True),
])
def test_chat_chunks_assemble_to_the_answer(message, finish, pieces, logprobs):
    resp = chat(message, finish, len(pieces), logprobs, {"token_ids": list(range(len(pieces)))})
    ChatCompletion.model_validate(resp)
    chunks = chat_chunks(resp, [pieces], include_usage=True)
    got, got_finish, entries, usage = assemble_chat(chunks)
    assert got == message and got_finish == finish and usage == resp["usage"]
    assert entries == (resp["choices"][0]["logprobs"]["content"] if logprobs else None)
    assert all(c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-2]["choices"][0]["token_ids"] == list(range(len(pieces)))  # the extension, last
    assert chunks[-1]["choices"] == []  # the usage chunk
    if message["content"] and logprobs:  # one chunk per content token, with its logprob
        first = [c for c in chunks[1:-1] if c["choices"][0]["delta"].get("content")]
        assert [len(c["choices"][0]["logprobs"]["content"]) for c in first] == [1] * len(first)


def test_completion_chunks_assemble_to_the_answer():
    text, pieces = "12+3", ["1", "2", "+", "3", ""]
    resp = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop",
                         "logprobs": {"tokens": ["1", "2", "+", "3", "</s>"],
                                      "token_logprobs": [-0.1, -0.2, -0.3, -0.4, -0.5],
                                      "text_offset": [0, 1, 2, 3, 4], "top_logprobs": None}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}
    chunks = completion_chunks(resp, [pieces])
    # the client reads each chunk as a Completion (finish_reason null until the last)
    parsed = [Completion.model_construct(**c) for c in chunks[:-1]] + [Completion.model_validate(chunks[-1])]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), []) \
        == resp["choices"][0]["logprobs"]["token_logprobs"]
    assert parsed[-1].choices[0].finish_reason == "stop"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 4
    assert len(chunks) == 5  # four tokens of text, the EOS's logprob with the finish reason


def test_n_choices_stream_each_under_its_index_and_the_usage_once():
    one = chat({"role": "assistant", "content": "12"}, "length", 2, True)
    two = chat({"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls", 3, True)
    resp = {**one, "choices": [one["choices"][0], {**two["choices"][0], "index": 1}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    chunks = chat_chunks(resp, [["1", "2"], ["<tool_call>", "...", ""]], include_usage=True)
    for i, choice in enumerate(resp["choices"]):
        message, finish, entries, usage = assemble_chat(chunks, i)
        assert (message, finish) == (choice["message"], choice["finish_reason"])
        assert entries == choice["logprobs"]["content"] and usage == resp["usage"]
    assert [c["choices"][0]["index"] for c in chunks[:-1]] == [0] * 4 + [1] * 4
    assert [c["choices"] for c in chunks].count([]) == 1
    with pytest.raises(ValueError):  # a choice without its pieces
        chat_chunks(resp, [["1", "2"]])


def test_the_event_stream_is_data_lines_ending_in_done():
    lines = list(EventStream([{"a": 1}, {"b": "x\ny"}]).lines())
    assert lines == ['data: {"a": 1}\n\n', 'data: {"b": "x\\ny"}\n\n', "data: [DONE]\n\n"]
    assert json.loads(lines[1][len("data: "):]) == {"b": "x\ny"}
