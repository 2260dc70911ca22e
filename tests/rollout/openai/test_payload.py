"""What a request body may be (payload.py) and which fields and routes the endpoint
refuses by name (protocol.py), table-driven; no engine, no Ray."""

import json

import pytest

from areal_ray.rollout.openai.payload import (
    MAX_JSON_DEPTH,
    check_fits,
    max_token_bytes,
    min_tokens,
    parse_body,
)
from areal_ray.rollout.openai.protocol import (
    APIError,
    Defaults,
    no_session,
    parse_chat,
    parse_completion,
    session_url,
    unknown_route,
)


def nested(depth: int) -> bytes:
    """A tool schema `depth` objects deep inside the body's `tools`."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return json.dumps({"model": "m", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": schema}}]}).encode()


@pytest.mark.parametrize("data,needle,param", [
    (b"{", "not JSON", None),
    (b"[1, 2]", "must be a JSON object, got list", None),
    (b'"text"', "must be a JSON object, got str", None),
    (b'{"model": "m\xff"}', "not UTF-8", None),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "lone surrogate", "messages"),
    (b'{"\\udfff": 1}', "lone surrogate", None),
    (b'{"seed": ' + b"9" * 5000 + b"}", "not JSON", None),  # past Python's int digits limit
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply", None),  # past the parser's recursion
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "nested too deeply", "a"),
    (nested(200), "nested too deeply at tools[0].function.parameters", "tools"),
])
def test_a_body_that_is_not_a_shallow_utf8_json_object_is_a_400_naming_why(data, needle, param):
    with pytest.raises(APIError) as e:
        parse_body(data)
    assert e.value.status == 400 and needle in e.value.message
    assert e.value.body()["error"] == {"message": e.value.message, "type": "invalid_request_error",
                                       "param": param, "code": None}


@pytest.mark.parametrize("data", [
    nested(20),
    b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\u00e9 \xc3\xa9"}]}',  # a pair, and UTF-8
    b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}",
])
def test_a_sound_body_parses(data):
    assert parse_body(data) == json.loads(data)


@pytest.mark.parametrize("n_bytes,token_bytes,context,refused", [
    (1275, 5, 256, False),  # at least 255 tokens: one left to generate
    (1276, 5, 256, True),  # at least 256
    (2 << 20, 5, 256, True),
    (2 << 20, 128, 32768, False),  # a long-token vocabulary: left to the tokenizer (off the loop)
    (10 ** 6, 5, None, False),  # no known context
])
def test_a_prompt_is_refused_by_its_bytes_when_no_tokenization_could_fit_it(
        n_bytes, token_bytes, context, refused):
    text = "é" * (n_bytes // 2) + "1" * (n_bytes % 2)
    assert len(text.encode()) == n_bytes
    if not refused:
        check_fits(text, context, token_bytes, "messages")
        return
    with pytest.raises(APIError) as e:
        check_fits(text, context, token_bytes, "messages")
    err = e.value.body()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert f"at least {min_tokens(n_bytes, token_bytes)} tokens" in err["message"]


def test_no_token_covers_more_bytes_than_the_bound(random_model_dir):
    """The bound holds on the test model's tokenizer: every token's decoded text,
    special tokens included, is at most max_token_bytes."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    bound = max_token_bytes(tok)
    assert bound >= 1
    assert max(len(tok.decode([i]).encode()) for i in tok.get_vocab().values()) <= bound


CHAT = {"model": "m", "messages": [{"role": "user", "content": "1+1="}]}


def encode(s: str) -> list[int]:
    return list(range(len(s)))


@pytest.mark.parametrize("extra,needle", [
    ({"parallel_tool_calls": False}, "parallel_tool_calls=False is not supported"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls="),
    ({"reasoning_effort": "low"}, "reasoning_effort='low' is not supported"),
    ({"verbosity": "high"}, "verbosity='high' is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities="),
    ({"seed": -1}, "seed must be an integer in [0, "),
    ({"seed": 2 ** 63}, "seed must be an integer in [0, "),
    ({"seed": "1"}, "seed must be an integer"),
    ({"seed": True}, "seed must be an integer"),
    ({"prompt_cache_retention": "24h"}, "unrecognized request argument(s): prompt_cache_retention"),
])
def test_fields_the_endpoint_cannot_honour_are_refused_by_name(extra, needle):
    with pytest.raises(APIError) as e:
        parse_chat({**CHAT, **extra}, Defaults(8, 1.0), encode)
    name = next(iter(extra))
    assert needle in e.value.message and e.value.param == name


@pytest.mark.parametrize("extra,seed", [
    ({}, None), ({"seed": 0}, 0), ({"seed": 2 ** 63 - 1}, 2 ** 63 - 1),
    ({"parallel_tool_calls": True, "seed": 7}, 7), ({"modalities": ["text"], "user": "u", "store": False}, None),
])
def test_seed_is_read_and_harmless_fields_pass(extra, seed):
    assert parse_chat({**CHAT, **extra}, Defaults(8, 1.0), encode).seed == seed
    if "parallel_tool_calls" not in extra and "modalities" not in extra:
        assert parse_completion({"model": "m", "prompt": "1", **extra}, Defaults(8, 1.0), encode).seed == seed


@pytest.mark.parametrize("url,session", [
    ("http://h:8000/rl/v1/chat/completions", "http://h:8000/rl/sessions/<sid>/v1"),
    ("http://h:8000/v1/responses?x=1", "http://h:8000/sessions/<sid>/v1"),
    ("http://h:8000/rl/sessions/s1/v1/responses", "http://h:8000/rl/sessions/<sid>/v1"),
])
def test_refusals_name_the_session_url_form(url, session):
    assert session_url(url) == session
    err = no_session(url).body()["error"]
    assert session in err["message"] and "x-areal-session" in err["message"]
    assert err["code"] == "session_required" and no_session(url).status == 400


@pytest.mark.parametrize("method,url,needles", [
    ("GET", "http://h/rl/sessions/s/v1/responses/resp_1",
     ["stores no responses", "OpenAIChatCompletionsModel", "use_responses_api=False"]),
    ("DELETE", "http://h/rl/v1/responses/resp_1", ["stores no responses"]),
    ("POST", "http://h/rl/sessions/s/v1/embeddings", ["no route POST http://h/rl/sessions/s/v1/embeddings",
                                                      "POST chat/completions", "POST responses",
                                                      "http://h/rl/sessions/<sid>/v1"]),
    ("GET", "http://h/rl/sessions/s/v1/chat/completions", ["no route GET"]),
])
def test_an_unknown_route_is_a_404_naming_what_to_use(method, url, needles):
    e = unknown_route(method, url)
    assert e.status == 404 and e.body()["error"]["message"] == e.message
    for needle in needles:
        assert needle in e.message
