"""Stop strings longer than one token (areal_ray/rollout/openai/stop_strings.py), without Ray:
the engine pauses at a string's last token and goes on when the string is not there
yet, the output ends after the token that completes the first string, and what is
recorded is exactly the tokens that were sampled up to there."""

import asyncio

import pytest

from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.openai.protocol import APIError, Defaults, stops
from areal_ray.rollout.openai.service import OpenAIService
from areal_ray.rollout.openai.sessions import SessionStore
from areal_ray.rollout.openai.stop_strings import first_stop
from areal_ray.task.tokenizer import build_char_tokenizer
from tests.rollout.workflows.test_base import _Method

TOK = build_char_tokenizer()


def encode(s):
    return TOK(s, add_special_tokens=False)["input_ids"]


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text,strings,k", [
    ("ab+1+2=3", ["+2"], 6), ("ab+1+2=3", ["=3", "+1"], 4), ("ab+1", ["+2"], None),
    ("+2", ["+2"], 2), ("ab", [], None),
])
def test_first_stop_is_the_token_that_completes_the_first_string(text, strings, k):
    assert first_stop(encode(text), strings, decode) == k


def test_stops_split_one_token_stops_from_stop_strings():
    ids, strings, pauses = stops(["=", "+2", "12", "x="], encode)
    assert ids == encode("=") and strings == ["+2", "12", "x="]
    assert pauses == encode("2")  # "x=" pauses at "=", already a stop id
    with pytest.raises(APIError, match="0 tokens"):
        stops([""], encode)


class ScriptApp:
    """An engine that writes `script` and honours stop ids (kept as the last token): each
    call continues the script where the request's ids leave it."""

    def __init__(self, prompt: str, script: str):
        self.n_prompt, self.script = len(encode(prompt)), encode(script) + [TOK.eos_token_id]
        self.generate_batch = _Method(self._generate_batch)
        self.calls = 0

    async def _generate_batch(self, requests):
        self.calls += 1
        ((ids, budget, stop_ids),) = [(r.input_ids, r.max_new_tokens, r.stop_ids) for r in requests]
        rest = self.script[len(ids) - self.n_prompt:][:budget]
        cut = next((i + 1 for i, t in enumerate(rest) if t in stop_ids), len(rest))
        out = rest[:cut]
        reason = "stop" if out and (out[-1] in stop_ids or out[-1] == TOK.eos_token_id) else "length"
        return [{"output_ids": out, "logprobs": [-1.0] * len(out), "versions": [3] * len(out),
                 "stop_reason": reason}]


@pytest.mark.parametrize("script,stop,text,calls", [
    ("3+1+3=7", ["+3"], "3+1+3", 2),  # paused at the first "3", went on, stopped at "+3"
    ("1+2+3=6", ["=6", "+"], "1+", 1),  # a one-token stop first
    ("1+2+3=6", ["9+"], "1+2+3=6", 3),  # never written: a pause at each "+", EOS ends it
    ("12+3=15", ["3="], "12+3=", 1),
])
def test_the_service_ends_the_output_at_the_first_stop_string(script, stop, text, calls):
    app = ScriptApp("q:", script)
    svc = OpenAIService(TOK, EngineClient(app), Defaults(50, 1.0), SessionStore(4, 60), "tiny")
    r = asyncio.run(svc.completions("s", {"model": "m", "prompt": "q:", "stop": stop,
                                          "return_token_ids": True}))
    choice = r["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "stop" and app.calls == calls
    (call,) = svc.session("s")["calls"]
    assert call["output_ids"] == choice["token_ids"] == app.script[:len(call["output_ids"])]
    assert call["logprobs"] == [-1.0] * len(call["output_ids"])


def test_a_stop_string_past_the_engines_stop_is_cut_off():
    """The model wrote the string with a token the pause did not see (here the engine
    ran on to its budget): the output still ends after it."""
    app = ScriptApp("q:", "ab+2cd")
    svc = OpenAIService(TOK, EngineClient(app), Defaults(50, 1.0), SessionStore(4, 60), "tiny")
    svc_req = {"model": "m", "prompt": "q:", "stop": ["b+2"], "max_tokens": 6}
    assert asyncio.run(svc.completions("s", svc_req))["choices"][0]["text"] == "ab+2"


def test_a_pause_at_the_end_of_the_budget_is_a_length_finish():
    app = ScriptApp("q:", "3+1+3=7")
    svc = OpenAIService(TOK, EngineClient(app), Defaults(50, 1.0), SessionStore(4, 60), "tiny")
    r = asyncio.run(svc.completions("s", {"model": "m", "prompt": "q:", "stop": ["+3"], "max_tokens": 1}))
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("3", "length")
