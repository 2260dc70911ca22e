"""What a request body may be before anything reads its fields: JSON of bounded depth
in strict UTF-8, and text that can fit the model's context, checked without
tokenizing it.

Why here: `json.loads` accepts what later code cannot take. A body nested a thousand
levels deep raises RecursionError (in the parser, or later in a chat template's
`tojson`), a `"\\ud800"` escape decodes to a lone surrogate that raises
UnicodeEncodeError wherever the text is encoded (the tokenizer, the response), and an
integer of 5000 digits raises ValueError: each was a plain-text 500. Each is the
request's fault, so each is a 400 in OpenAI's format, found while parsing.

The context check: a prompt is tokenized on the endpoint before its length in tokens
is known, and tokenizing megabytes takes seconds. No token covers more bytes of text
than the longest string in the tokenizer's vocabulary (`max_token_bytes`: its UTF-8
length, which is at least the bytes the token stands for: byte-level BPE writes each
byte as a character of 1 or 2 bytes, SentencePiece a space as the 3-byte `▁` and a
fallback byte as `<0xNN>`; special tokens are in the vocabulary too). So a text of B
bytes is at least ceil(B / L) tokens, and one whose bound passes the context cannot
fit however it is tokenized: refused from its byte count alone (`check_fits`).
The bound assumes the tokenizer's normalizer does not shrink text by more than the
vocabulary strings over-count; none of the families above does.

Pure: no Serve; the service passes the text and the numbers.
"""

from __future__ import annotations

import json

from areal_ray.rollout.openai.protocol import CONTEXT_LENGTH_EXCEEDED, APIError, bad

# Deeper than any tool schema or message a framework sends (a JSON schema of nested
# objects is a few levels per level of nesting), far below Python's recursion limit.
MAX_JSON_DEPTH = 64


def parse_body(data: bytes) -> dict:
    """The request's JSON object; a 400 naming the problem for anything else: bytes
    that are not UTF-8, text that is not JSON, nesting past MAX_JSON_DEPTH, a string
    holding a lone surrogate, a number Python refuses to read."""
    try:
        text = data.decode("utf-8")  # strict: an invalid byte is the client's error
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not UTF-8: {e}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise bad(f"the request body is nested too deeply: at most {MAX_JSON_DEPTH} levels "
                  "of objects and arrays") from None
    except ValueError as e:  # JSONDecodeError, and int() refusing thousands of digits
        raise bad(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    check_structure(body)
    return body


def check_structure(value) -> None:
    """Raise a 400 when `value` (parsed JSON) nests deeper than MAX_JSON_DEPTH or holds
    a string (or key) with a lone surrogate. Iterative: no recursion to exhaust."""
    stack = [(value, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
            continue
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body is nested too deeply at {where or 'the top'}: at most "
                      f"{MAX_JSON_DEPTH} levels of objects and arrays", _param(where))
        if isinstance(v, dict):
            for k, item in v.items():
                _check_text(k, where)
                stack.append((item, depth + 1, f"{where}.{k}" if where else k))
        else:
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(v))


def _param(where: str) -> str | None:
    """The top-level field a path is in (OpenAI's `param`)."""
    return where.split(".")[0].split("[")[0] or None


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{where or 'a key'}: the text holds a lone surrogate "
                  f"({s[e.start]!r} at character {e.start}), which is not valid Unicode: "
                  "send UTF-8 text (a surrogate pair escapes one character)", _param(where)) from None


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of text one token can cover: the longest vocabulary string,
    special tokens included (see the module docstring)."""
    vocab = tokenizer.get_vocab()
    extra = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    return max([len(t.encode("utf-8", "replace")) for t in (*vocab, *extra)] + [1])


def min_tokens(n_bytes: int, token_bytes: int) -> int:
    """The fewest tokens `n_bytes` of text can be, with at most `token_bytes` a token."""
    return -(-n_bytes // token_bytes)


def check_fits(text: str, max_context: int | None, token_bytes: int, param: str) -> None:
    """Refuse `text` (a prompt, rendered) that cannot fit `max_context` tokens with room
    for one more, however it tokenizes: its UTF-8 byte count alone shows it."""
    if max_context is None:
        return
    n = len(text.encode("utf-8"))
    least = min_tokens(n, token_bytes)
    if least >= max_context:
        raise APIError(400, f"the prompt is {n} bytes, at least {least} tokens (no token of this "
                            f"model's tokenizer covers more than {token_bytes} bytes), and the "
                            f"model's context is {max_context}: no room is left to generate",
                       param, CONTEXT_LENGTH_EXCEEDED)
