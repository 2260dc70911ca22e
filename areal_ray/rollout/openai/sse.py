"""`stream: true` on the OpenAI endpoint: the answer as server-sent events in OpenAI's
chunk format (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`), which the `openai`
client and agent frameworks read.

The endpoint's generation returns whole (an engine call, with interruptible
resubmission inside it), so the chunks are cut from the finished answer, after it is
recorded: this is the wire format of streaming, not early tokens. In exchange the
chunks assemble to exactly the non-streamed answer (content, tool calls, logprobs,
finish reason: one parse, one truth), and a bad request is still a plain 400 with
OpenAI's error body, since nothing is sent before the answer exists.

Content is cut at token boundaries (one chunk per output token, with that token's
logprob entry), when the tokens' texts concatenate to the content; otherwise (a
multi-byte character split across tokens) it goes in one chunk. Each tool call is two
chunks: its id and name, then its arguments. The last chunk carries the finish reason
(and our `return_token_ids` extension fields); `stream_options.include_usage` adds
OpenAI's usage chunk with no choices. With `n > 1` each choice's chunks carry its
`index`, one choice after the other (a client assembles them by index), and the usage
chunk comes once, after all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class EventStream:
    """What the service answers for `stream: true`: the chunks, sent by the deployment."""
    chunks: list[dict]

    def lines(self):
        for c in self.chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    def response(self):
        from starlette.responses import StreamingResponse
        return StreamingResponse(self.lines(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def cut(text: str, pieces: list[str]) -> tuple[list[tuple[str, int, int]], int]:
    """`text` cut at token boundaries: ([(segment, first token, end token)], the index of
    the first token after `text`). `pieces` are the output tokens' texts; when they do
    not spell `text`, it is one segment over all tokens."""
    if not "".join(pieces).startswith(text):
        return ([(text, 0, len(pieces))] if text else []), len(pieces)
    segments, at = [], 0
    for i, p in enumerate(pieces):
        if at >= len(text):
            return segments, i
        segments.append((text[at:at + len(p)], i, i + 1))
        at += len(p)
    return segments, len(pieces)


def _chunk(resp: dict, obj: str, index: int, choice: dict) -> dict:
    return {"id": resp["id"], "object": obj, "created": resp["created"], "model": resp["model"],
            "choices": [{"index": index, "logprobs": None, "finish_reason": None, **choice}]}


def _extras(choice: dict, known: set[str]) -> dict:
    return {k: v for k, v in choice.items() if k not in known}


def _usage_chunk(resp: dict, obj: str) -> dict:
    return {"id": resp["id"], "object": obj, "created": resp["created"], "model": resp["model"],
            "choices": [], "usage": resp["usage"]}


def chat_chunks(resp: dict, pieces: list[list[str]], include_usage: bool = False) -> list[dict]:
    """The `chat.completion.chunk`s of the chat answer `resp` (chat_response's JSON);
    `pieces`: per choice, its output tokens' texts as the client sees them."""
    obj = "chat.completion.chunk"
    chunks = [c for choice, ps in zip(resp["choices"], pieces, strict=True)
              for c in _chat_choice_chunks(resp, obj, choice, ps)]
    return chunks + ([_usage_chunk(resp, obj)] if include_usage else [])


def _chat_choice_chunks(resp: dict, obj: str, choice: dict, pieces: list[str]) -> list[dict]:
    i, message, entries = choice["index"], choice["message"], (choice["logprobs"] or {}).get("content")
    segments, rest = cut(message.get("content") or "", pieces)

    def lp(lo, hi):
        return None if entries is None else {"content": entries[lo:hi], "refusal": None}

    chunks = [_chunk(resp, obj, i, {"delta": {"role": "assistant", "content": ""}})]
    chunks += [_chunk(resp, obj, i, {"delta": {"content": s}, "logprobs": lp(lo, hi)})
               for s, lo, hi in segments]
    for j, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        chunks.append(_chunk(resp, obj, i, {"delta": {"tool_calls": [
            {"index": j, "id": call["id"], "type": "function",
             "function": {"name": fn["name"], "arguments": ""}}]}}))
        chunks.append(_chunk(resp, obj, i, {"delta": {"tool_calls": [
            {"index": j, "function": {"arguments": fn["arguments"]}}]}}))
    last = {"delta": {}, "finish_reason": choice["finish_reason"],
            **_extras(choice, {"index", "message", "finish_reason", "logprobs"})}
    if entries is not None and rest < len(entries):  # tokens past the content: calls, EOS
        last["logprobs"] = lp(rest, len(entries))
    chunks.append(_chunk(resp, obj, i, last))
    return chunks


def completion_chunks(resp: dict, pieces: list[list[str]], include_usage: bool = False) -> list[dict]:
    """The `text_completion` chunks of the completion answer `resp`; `pieces` per choice."""
    obj = "text_completion"
    chunks = [c for choice, ps in zip(resp["choices"], pieces, strict=True)
              for c in _completion_choice_chunks(resp, obj, choice, ps)]
    return chunks + ([_usage_chunk(resp, obj)] if include_usage else [])


def _completion_choice_chunks(resp: dict, obj: str, choice: dict, pieces: list[str]) -> list[dict]:
    i, lps = choice["index"], choice["logprobs"]
    segments, rest = cut(choice["text"], pieces)

    def lp(lo, hi):
        if lps is None:
            return None
        return {"tokens": lps["tokens"][lo:hi], "token_logprobs": lps["token_logprobs"][lo:hi],
                "text_offset": lps["text_offset"][lo:hi], "top_logprobs": None}

    chunks = [_chunk(resp, obj, i, {"text": s, "logprobs": lp(lo, hi)}) for s, lo, hi in segments]
    last = {"text": "", "finish_reason": choice["finish_reason"],
            **_extras(choice, {"index", "text", "finish_reason", "logprobs"})}
    if lps is not None and rest < len(lps["tokens"]):
        last["logprobs"] = lp(rest, len(lps["tokens"]))
    chunks.append(_chunk(resp, obj, i, last))
    return chunks
