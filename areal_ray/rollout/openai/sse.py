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
logprob entry), the tokens' texts read as an incremental detokenizer reads them
(`token_texts`): a token that ends inside a multi-byte character (byte-fallback
tokens) sends nothing and the token that completes the character sends all of it, in
one chunk with the logprob entries of both, so no chunk holds half a character or
U+FFFD; where the texts do not concatenate to the content, it goes in one chunk. Each tool call is two
chunks: its id and name, then its arguments. The last chunk carries the finish reason
(and our `return_token_ids` extension fields); `stream_options.include_usage` adds
OpenAI's usage chunk with no choices. With `n > 1` each choice's chunks carry its
`index`, one choice after the other (a client assembles them by index), and the usage
chunk comes once, after all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of an unfinished character


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


def token_texts(ids: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Each token's share of `decode(ids)`, as it can be sent once the token exists: a
    token's text is read after the tokens before it (alone, SentencePiece's "▁world"
    decodes to "world", without its space), and a token that ends inside a character
    gets "" while the one that completes it gets the whole character. They concatenate
    to `decode(ids)`; where a tokenizer's decode does not extend as ids are added, each
    token's text alone (and `cut` then sends the content as one chunk)."""
    texts, start, sent = [], 0, 0  # decode(ids[start:sent]): the text sent, read from `start`
    for i in range(1, len(ids) + 1):
        before, now = decode(ids[start:sent]), decode(ids[start:i])
        if i < len(ids) and (now.endswith(REPLACEMENT) or not now.startswith(before)):
            texts.append("")  # held until a later token completes it
            continue
        texts.append(now[len(before):])
        start, sent = sent, i  # the next token is read after this one
    if "".join(texts) != decode(ids):
        return [decode([t]) for t in ids]
    return texts


def cut(text: str, pieces: list[str]) -> tuple[list[tuple[str, int, int]], int]:
    """`text` cut at token boundaries: ([(segment, first token, end token)], the index of
    the first token after `text`). `pieces` are the output tokens' texts (`token_texts`);
    a token with no text yet goes in the segment of the token that completes it; when
    they do not spell `text`, it is one segment over all tokens."""
    if not "".join(pieces).startswith(text):
        return ([(text, 0, len(pieces))] if text else []), len(pieces)
    segments, at, first = [], 0, 0
    for i, p in enumerate(pieces):
        if at >= len(text):
            return segments, i
        if p:
            segments.append((text[at:at + len(p)], first, i + 1))
            at, first = at + len(p), i + 1
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
