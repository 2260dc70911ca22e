"""The OpenAI endpoint's request handling without Ray, on a real engine in this process:
responses the `openai` package's types accept, a multi-turn chat recorded as one
trajectory with exact prefix reuse, versions that change with a weight update between
turns, stop strings, and 400s naming the problem. Over HTTP with the real client and
Serve: tests/deployments/test_openai_api.py."""

import asyncio
import copy
import json
from types import MethodType, SimpleNamespace

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from starlette.requests import Request

from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.engines.limits import RequestLimits
from areal_ray.rollout.openai.protocol import APIError, Defaults, stop_ids
from areal_ray.rollout.openai.service import OpenAIService
from areal_ray.rollout.openai.sessions import SessionStore
from deployments.openai_api import OpenAIServer
from tests.rollout.engines.test_limits import until_running
from tests.rollout.workflows.test_base import InProcessApp, _Method


@pytest.fixture(scope="module")
def engine(random_model_dir):
    return HFEngine(random_model_dir)


def service(engine, tokenizer=None, limits=None, max_tokens_cap=None, app=None):
    return OpenAIService(tokenizer or engine.tokenizer, EngineClient(app or InProcessApp(engine)),
                         Defaults(max_tokens=8, temperature=1.0),
                         SessionStore(max_sessions=16, ttl_s=600), model_name="tiny",
                         limits=limits, max_tokens_cap=max_tokens_cap)


def run(coro):
    return asyncio.run(coro)


def test_completion_and_chat_parse_as_the_client_does(engine):
    torch.manual_seed(0)
    svc = service(engine)
    c = run(svc.completions("s1", {"model": "m", "prompt": "12+3=", "max_tokens": 5,
                                   "logprobs": 1, "return_token_ids": True}))
    comp = Completion.model_validate(c)
    choice = comp.choices[0]
    assert comp.object == "text_completion" and comp.model == "m"
    assert choice.finish_reason in ("stop", "length") and comp.usage.completion_tokens <= 5
    assert len(choice.logprobs.token_logprobs) == comp.usage.completion_tokens
    rec = svc.session("s1")["calls"][0]
    assert rec["output_ids"] == c["choices"][0]["token_ids"]
    assert rec["prompt_ids"] == engine.tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    assert choice.text == engine.tokenizer.decode(rec["output_ids"], skip_special_tokens=True)

    ch = ChatCompletion.model_validate(run(svc.chat("s2", {
        "model": "m", "messages": [{"role": "user", "content": "7+8="}],
        "max_completion_tokens": 4, "logprobs": True, "temperature": 0.5})))
    assert ch.object == "chat.completion" and ch.choices[0].message.role == "assistant"
    assert len(ch.choices[0].logprobs.content) == ch.usage.completion_tokens <= 4
    assert svc.models()["data"][0]["id"] == "tiny"


def test_a_three_turn_chat_is_one_trajectory_with_exact_prefix_reuse(engine, random_model_dir):
    """Turn 2 runs on updated weights (version 1): the recorded versions show it."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(1)
    svc = service(engine)
    messages = [{"role": "user", "content": "12+3="}]
    prompts = []
    for turn in range(3):
        if turn == 1:
            model = AutoModelForCausalLM.from_pretrained(random_model_dir)
            run(engine.update_weights(model.state_dict(), 1, "abort"))
        r = run(svc.chat("chat", {"model": "m", "messages": messages, "max_tokens": 6,
                                  "return_token_ids": True}))
        prompts.append(r["choices"][0]["prompt_token_ids"])
        messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "tool", "content": f"={turn}"}]
    calls = svc.session("chat")["calls"]
    for prev, nxt in zip(calls, calls[1:]):  # each prompt extends the previous ids exactly
        history = prev["prompt_ids"] + prev["output_ids"]
        assert nxt["prompt_ids"][:len(history)] == history and nxt["extends"] is not None
    (sample,) = svc.session("chat")["samples"]
    tool = lambda t: engine.tokenizer(f"={t}", add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = calls[0]["output_ids"] + tool(0) + calls[1]["output_ids"] + tool(1) + calls[2]["output_ids"]
    assert sample["prompt_ids"] == calls[0]["prompt_ids"] and sample["output_ids"] == expected
    n = [len(c["output_ids"]) for c in calls]
    assert sample["loss_mask"] == [1] * n[0] + [0] * 2 + [1] * n[1] + [0] * 2 + [1] * n[2]
    assert sample["versions"] == [0] * n[0] + [-1] * 2 + [1] * n[1] + [-1] * 2 + [1] * n[2]
    assert (sample["n_turns"], sample["tool_calls"]) == (3, 2)
    run(engine.update_weights(AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict(), 0))


def test_stop_strings_are_stop_ids_and_end_the_output(engine):
    torch.manual_seed(2)
    tok = engine.tokenizer
    stops = ["1", "2", "+", "="]
    ids = stop_ids(stops, lambda s: tok(s, add_special_tokens=False)["input_ids"])
    assert len(ids) == 4
    svc = service(engine)
    for i in range(4):
        r = run(svc.completions(f"stop{i}", {"model": "m", "prompt": "3", "max_tokens": 30,
                                             "stop": stops, "return_token_ids": True}))
        out = r["choices"][0]["token_ids"]
        assert not set(out[:-1]) & set(ids)  # a stop id only ever ends the output
        if out[-1] in ids:
            assert r["choices"][0]["finish_reason"] == "stop"
            assert r["choices"][0]["text"].endswith(tok.decode([out[-1]]))  # kept in the text


@pytest.mark.parametrize("body,needle", [
    ({"stop": ""}, "0 tokens"),
    ({"n": 17}, "n must be an integer in [1, 16]"),
    ({"stream": "yes"}, "stream must be a boolean"),
    ({"stream": True, "stream_options": 1}, "stream_options must be"),
    ({"top_p": 0.5}, "top_p"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice='required' is not supported"),
    ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "tool_calls must be a list"),
    ({"temperature": 3}, "temperature must be"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"bogus": 1}, "unrecognized request argument(s): bogus"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"model": None}, "model: a string is required"),
])
def test_bad_chat_requests_are_400s_naming_the_problem(engine, body, needle):
    svc = service(engine)
    req = {"model": "m", "messages": [{"role": "user", "content": "1+1="}], **body}
    with pytest.raises(APIError) as e:
        run(svc.chat("bad", req))
    assert e.value.status == 400 and needle in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_a_tokenizer_without_a_chat_template_is_a_400(engine):
    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = None
    with pytest.raises(APIError, match="has no chat template") as e:
        run(service(engine, tok).chat("t", {"model": "m", "messages": [{"role": "user", "content": "1"}]}))
    assert e.value.status == 400


def test_budgets_are_cut_to_the_context_and_unknown_sessions_are_404s(engine):
    svc = service(engine, limits=RequestLimits(None, 8))
    r = run(svc.completions("ctx", {"model": "m", "prompt": "12+3=", "max_tokens": 50}))
    assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] <= 8
    with pytest.raises(APIError, match="context is 8") as full:
        run(svc.completions("ctx2", {"model": "m", "prompt": "123456789"}))
    # OpenAI's code for it, which agents (and AgentWorkflow) tell from other 400s by
    assert full.value.body()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(APIError) as other:
        run(svc.completions("ctx3", {"model": "m", "prompt": "1", "max_tokens": 0}))
    assert other.value.status == 400 and other.value.body()["error"]["code"] is None
    for fn in (svc.session, svc.delete):
        with pytest.raises(APIError) as e:
            fn("nope")
        assert e.value.status == 404
    assert svc.delete("ctx") == {"id": "ctx", "deleted": True}
    with pytest.raises(APIError, match="one prompt per request"):
        run(svc.completions("b", {"model": "m", "prompt": ["a", "b"]}))



# ----------------------------------------------------------------- bad requests
def test_a_token_prompt_the_engine_cannot_run_is_a_400_and_concurrent_rollouts_complete(engine):
    """An agent's token-id prompt with an id outside the vocabulary, while training
    rollouts run on the same engine: the agent gets a 400 naming the id, the
    rollouts get their whole budget (the service here has no limits of its own: the
    engine's guard refuses it)."""
    version = engine.get_version()
    rollouts = [GenerationRequest([5 + i, 6, 7], 150, 1.0, ignore_eos=True) for i in range(3)]

    async def scenario():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in rollouts]
        await until_running(engine, len(rollouts))
        with pytest.raises(APIError) as e:
            await service(engine).completions("oov", {"model": "m", "prompt": [5, 10_000]})
        return e.value, await asyncio.gather(*tasks)

    err, results = run(scenario())
    assert err.status == 400 and "prompt token 1 is id 10000, outside the model's vocabulary" in err.message
    assert err.body()["error"]["param"] == "prompt"
    assert all(len(r.output_ids) == 150 and r.versions == [version] * 150 for r in results)


@pytest.mark.parametrize("prompt,needle", [
    ([5, 10_000], "prompt token 1 is id 10000, outside the model's vocabulary [0, 87)"),
    ([-2, 5], "prompt token 0 is id -2, outside"),
    ([5] * 300, "the prompt is 300 tokens and the model's context is 256"),
    ("7" * 300, "the prompt is 300 tokens and the model's context is 256"),
])
def test_a_prompt_outside_the_models_limits_is_a_400_before_anything_is_generated(
        engine, random_model_dir, prompt, needle):
    svc = service(engine, limits=RequestLimits.from_pretrained(random_model_dir))
    prefills = engine.load()["prefills"]
    with pytest.raises(APIError) as e:
        run(svc.completions("bad", {"model": "m", "prompt": prompt}))
    assert e.value.status == 400 and needle in e.value.message
    assert engine.load()["prefills"] == prefills


def test_max_tokens_is_cut_to_the_runs_max_new_tokens(engine):
    budgets = []
    app = InProcessApp(engine)

    async def recording(requests):
        budgets.append([r.max_new_tokens for r in requests])
        return await app._generate_batch(requests)

    app.generate_batch = _Method(recording)
    svc = service(engine, max_tokens_cap=3, app=app)
    r = run(svc.completions("cap", {"model": "m", "prompt": "12+3=", "max_tokens": 50}))
    run(svc.chat("cap2", {"model": "m", "messages": [{"role": "user", "content": "1"}],
                          "max_completion_tokens": 2}))
    assert budgets == [[3], [2]] and r["usage"]["completion_tokens"] <= 3


def test_a_request_the_replica_refuses_is_a_400(random_model_dir):
    """The replicas' engine may have a shorter context than the endpoint knows of
    (here: none known to the endpoint, 8 tokens to the engine)."""
    short = HFEngine(random_model_dir, max_model_len=8)
    with pytest.raises(APIError) as e:
        run(service(short).completions("long", {"model": "m", "prompt": "123456789"}))
    assert e.value.status == 400 and "the prompt is 9 tokens and the model's context is 8" in e.value.message


KEY = "service-key-0123456789"


def http_request(body: dict, key: str | None = KEY) -> Request:
    data = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"",
                    "headers": headers}, receive)


def handler(engine, max_request_bytes=1 << 20):
    """The deployment's methods on a service, without Serve: one shard."""
    from areal_ray.rollout.openai.affinity import MemoryKV, SessionRegistry
    from areal_ray.rollout.openai.auth import RequestGuard
    from deployments.openai_api import SessionShard
    cls = OpenAIServer.func_or_class
    local = SessionShard.of(service(engine), SessionRegistry(MemoryKV(), "t", "i0", "OpenAI-0#t"), "OpenAI-0#t")
    server = SimpleNamespace(local=local, guard=RequestGuard(KEY, max_request_bytes), shards=[], n=1)
    server._serve = MethodType(cls._serve, server)
    return cls, server


@pytest.mark.parametrize("prompt,status", [([5, 10_000], 400), ([-2], 400), ([5, 6], 200)])
def test_the_endpoints_handler_answers_a_bad_token_prompt_with_a_400(engine, prompt, status):
    cls, server = handler(engine)
    res = run(cls.completions(server, "h", http_request({"model": "m", "prompt": prompt,
                                                         "max_tokens": 2})))
    body = json.loads(res.body)
    assert res.status_code == status
    assert ("outside the model's vocabulary" in body["error"]["message"]) if status == 400 \
        else body["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("key,size,status", [(None, 10, 401), ("wrong-key-0123456789", 10, 401),
                                              (KEY, 10, 200), (KEY, 4000, 413)])
def test_the_handler_checks_the_key_then_the_size_before_the_body(engine, key, size, status):
    cls, server = handler(engine, max_request_bytes=2000)
    res = run(cls.completions(server, "auth", http_request(
        {"model": "m", "prompt": "1" * size, "max_tokens": 1}, key)))
    assert res.status_code == status
    if status != 200:
        assert json.loads(res.body)["error"]["message"]
    assert (server.local.service.store.get("auth") is not None) == (status == 200)


def test_a_full_store_is_a_429_and_session_ids_are_checked(engine):
    svc = OpenAIService(engine.tokenizer, EngineClient(InProcessApp(engine)), Defaults(4, 1.0),
                        SessionStore(max_sessions=1, ttl_s=600), model_name="tiny")
    svc.open_session("one", {})
    with pytest.raises(APIError) as e:
        svc.open_session("two", {})
    assert e.value.status == 429 and e.value.body()["error"]["type"] == "rate_limit_error"
    assert svc.session("one")["id"] == "one"  # the live session was not evicted for it
    for sid in ("", "a/b", "a b", "x" * 201, "é"):
        with pytest.raises(APIError, match="session id") as e:
            svc.open_session(sid, {})
        assert e.value.status == 400


def test_a_call_past_the_sessions_byte_budget_is_a_400_and_only_its_own(engine):
    svc = OpenAIService(engine.tokenizer, EngineClient(InProcessApp(engine)), Defaults(2, 1.0),
                        SessionStore(max_sessions=4, ttl_s=600, max_session_bytes=2000),
                        model_name="tiny")
    run(svc.completions("big", {"model": "m", "prompt": "1" * 100}))
    with pytest.raises(APIError, match="max_session_bytes") as e:
        run(svc.completions("big", {"model": "m", "prompt": "2" * 150}))
    assert e.value.status == 400
    assert len(svc.session("big")["calls"]) == 1  # what it had is kept
    run(svc.completions("small", {"model": "m", "prompt": "2" * 150}))


def test_a_refusal_coming_back_through_ray_is_a_400_with_the_replicas_message(engine):
    """Serve raises a replica's exception as a RayTaskError that is also an instance of
    the replica's exception class (`as_instanceof_cause`), whose text is a traceback:
    the agent gets the replica's own message."""
    from ray.exceptions import RayTaskError

    from areal_ray.rollout.engines.limits import RequestRejected
    cause = RequestRejected("the prompt is 9 tokens and the model's context is 8: no room is left")
    raised = RayTaskError("RolloutServer.generate_batch", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(raised, RequestRejected)

    async def refuse(*args):
        raise raised

    app = InProcessApp(engine)
    app.generate_batch = _Method(refuse)
    with pytest.raises(APIError) as e:
        run(service(engine, app=app).completions("ray", {"model": "m", "prompt": "12"}))
    assert e.value.status == 400 and e.value.message == str(cause)


@pytest.mark.parametrize("engine_kwargs,context", [({}, 256), ({"max_model_len": 64}, 64),
                                                   ({"context_length": 32}, 32)])
def test_the_endpoint_checks_with_the_models_limits_and_the_runs_max_new_tokens(
        random_model_dir, engine_kwargs, context):
    from areal_ray.config import load_config
    from deployments.openai_api import EndpointOptions
    cfg = load_config(None, ["rollout.max_new_tokens=12", f"rollout.openai.api_key={KEY}",
                             "rollout.openai.max_session_bytes=4096", "rollout.openai.max_sessions=5"])
    cfg.rollout.engine_kwargs = engine_kwargs
    with pytest.raises(ValueError, match="api_key is empty"):
        EndpointOptions.from_config(load_config(None, []).rollout)
    user_class = OpenAIServer.func_or_class.__mro__[1]  # the class under Serve's ingress wrapper
    assert user_class.__name__ == "OpenAIServer"
    server = SimpleNamespace()
    user_class.__init__(server, None, random_model_dir, EndpointOptions.from_config(cfg.rollout))
    svc = server.local.service
    assert svc.limits == RequestLimits(87, context) and svc.max_tokens_cap == 12
    assert svc.defaults.max_tokens == 12
    assert (svc.store.max_session_bytes, svc.store.max_sessions) == (4096, 5)
    assert server.guard.api_key == KEY and KEY not in repr(EndpointOptions.from_config(cfg.rollout))


def test_n_choices_are_each_recorded_as_their_own_sample(engine):
    """n=3 with a stop string (each choice pauses on its own): 3 choices, usage counting
    every choice's tokens once the prompt, 3 calls and 3 Samples of the same prompt ids."""
    svc = service(engine)
    got = run(svc.completions("n", {"model": "m", "prompt": "12+3=", "n": 3, "max_tokens": 4,
                                    "stop": ["+1"], "return_token_ids": True}))
    comp = Completion.model_validate(got)
    assert [c.index for c in comp.choices] == [0, 1, 2]
    calls = svc.session("n")["calls"]
    assert [c["output_ids"] for c in calls] == [c.model_extra["token_ids"] for c in comp.choices]
    assert comp.usage.completion_tokens == sum(len(c["output_ids"]) for c in calls)
    assert comp.usage.prompt_tokens == len(calls[0]["prompt_ids"])
    samples = svc.session("n")["samples"]
    assert len(samples) == 3 and len({tuple(s["prompt_ids"]) for s in samples}) == 1


def test_n_streamed_choices_assemble_to_the_recorded_calls(engine):
    """stream=true with n=2: each choice's chunks assemble to the text of its own recorded
    call, and the usage chunk counts both."""
    from tests.rollout.openai.test_sse import assemble_chat
    svc = service(engine)
    got = run(svc.chat("ns", {"model": "m", "messages": [{"role": "user", "content": "12+3="}],
                              "n": 2, "max_tokens": 4, "stream": True,
                              "stream_options": {"include_usage": True}}))
    calls = svc.session("ns")["calls"]
    assert len(calls) == 2
    for i, call in enumerate(calls):
        message, finish, _, usage = assemble_chat(got.chunks, i)
        assert message["content"] == engine.tokenizer.decode(call["output_ids"], skip_special_tokens=True)
        assert finish in ("stop", "length")
    assert usage["completion_tokens"] == sum(len(c["output_ids"]) for c in calls)


# ------------------------------------------- seeds, sizes, structure and routes
def test_a_seed_is_honoured_the_same_seed_draws_the_same_tokens(engine):
    """Each choice's call is seeded from the request's seed (rollout/seeds.py), as the
    engine receives it; two sessions with one seed sample the same tokens at
    temperature 1, as a run's seeded rollouts do (HFEngine samples each seeded row
    from its own generator)."""
    from areal_ray.rollout.seeds import request_seed
    seeds, app = [], InProcessApp(engine)

    async def recording(requests):
        seeds.append([r.seed for r in requests])
        return await app._generate_batch(requests)

    app.generate_batch = _Method(recording)
    svc = service(engine, app=app)
    body = {"model": "m", "prompt": "12+3=", "max_tokens": 8, "temperature": 1.0,
            "return_token_ids": True}
    outs = [run(svc.completions(sid, {**body, "seed": 11, "n": 2}))["choices"] for sid in ("a", "b")]
    run(svc.completions("c", body))
    assert seeds == [[request_seed(11, 0, 0, 0), request_seed(11, 0, 1, 0)]] * 2 + [[None]]
    assert [c["token_ids"] for c in outs[0]] == [c["token_ids"] for c in outs[1]]


class SlowTokenizer:
    """The model's tokenizer, as slow as a long prompt makes it on one text: encoding a
    text that starts with `marker` waits until `release` is set; every text it is asked
    to encode is noted."""

    def __init__(self, tokenizer, marker: str = "99999"):
        import threading
        self._tok, self.marker, self.release = tokenizer, marker, threading.Event()
        self.encoded: list[str] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, **kwargs):
        self.encoded.append(text)
        if text.startswith(self.marker):
            self.release.wait(timeout=30)  # a bound on a failing run, not a timing
        return self._tok(text, **kwargs)


def test_a_prompt_that_cannot_fit_is_refused_by_its_bytes_before_it_is_tokenized(engine):
    tok = SlowTokenizer(engine.tokenizer)
    svc = service(engine, tokenizer=tok, limits=RequestLimits(87, 256))
    big = "1" * 256 * svc.token_bytes  # at least 256 tokens whatever the tokenizer does
    for call in (svc.completions("big", {"model": "m", "prompt": big}),
                 svc.chat("big", {"model": "m", "messages": [{"role": "tool", "content": big}]})):
        with pytest.raises(APIError) as e:
            run(call)
        assert e.value.body()["error"]["code"] == "context_length_exceeded"
        assert f"the prompt is {len(big)} bytes, at least" in e.value.message
    assert not [t for t in tok.encoded if len(t) >= len(big)]  # never tokenized


def test_a_long_tokenization_does_not_hold_up_another_sessions_call(engine):
    """Session `slow`'s prompt takes until session `fast`'s call has finished to
    tokenize: it is tokenized off the event loop, so `fast` finishes meanwhile (on the
    loop it would wait for `slow`'s tokenization, which waits for it)."""
    tok = SlowTokenizer(engine.tokenizer)
    svc, order = service(engine, tokenizer=tok), []

    async def slow():
        await svc.completions("slow", {"model": "m", "prompt": "99999+1=", "max_tokens": 2})
        order.append("slow")

    async def fast():
        while not [t for t in tok.encoded if t.startswith(tok.marker)]:
            await asyncio.sleep(0.01)  # until `slow` is tokenizing
        await svc.chat("fast", {"model": "m", "messages": [{"role": "user", "content": "1+1="}],
                                "max_tokens": 2})
        order.append("fast")
        tok.release.set()

    async def both():
        await asyncio.gather(slow(), fast())

    run(both())
    assert order == ["fast", "slow"]
    assert len(svc.session("slow")["calls"]) == len(svc.session("fast")["calls"]) == 1


def raw_request(data: bytes, path: str = "/", method: str = "POST", headers=()) -> Request:
    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    hs = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode()),
          *[(k.encode(), v.encode()) for k, v in headers]]
    return Request({"type": "http", "method": method, "path": path, "query_string": b"",
                    "headers": hs, "scheme": "http", "server": ("h", 8000)}, receive)


@pytest.mark.parametrize("data,needle", [
    (b'{"model": "m", "prompt": "a\\ud800"}', "lone surrogate"),
    (b'{"model": "m", "prompt": "\xff"}', "not UTF-8"),
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    (json.dumps({"model": "m", "prompt": "1", "tools": [json.loads('{"a":' * 100 + "1" + "}" * 100)]}).encode(),
     "nested too deeply"),
])
def test_the_handler_answers_a_malformed_body_with_a_400_in_openais_format(engine, data, needle):
    cls, server = handler(engine)
    res = run(cls.completions(server, "malformed", raw_request(data)))
    err = json.loads(res.body)["error"]
    assert res.status_code == 400 and needle in err["message"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


def test_routes_without_a_session_and_unknown_routes_name_what_to_use(engine):
    """`<prefix>/v1` with the session header is that session's (chat and the Responses
    API alike); without it a 400 naming the session URL; a stored response and any
    other path a 404 in OpenAI's format naming what there is."""
    cls, server = handler(engine)
    for name in ("_by_header", "_refuse"):
        setattr(server, name, MethodType(getattr(cls, name), server))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "1+1="}],
                       "max_tokens": 2}).encode()
    ok = run(cls.chat_completions_by_header(server, raw_request(
        body, "/rl/v1/chat/completions", headers=[("x-areal-session", "hdr")])))
    assert ok.status_code == 200 and len(server.local.service.session("hdr")["calls"]) == 1
    none = run(cls.chat_completions_by_header(server, raw_request(body, "/rl/v1/chat/completions")))
    err = json.loads(none.body)["error"]
    assert none.status_code == 400 and "http://h:8000/rl/sessions/<sid>/v1" in err["message"]
    resp = run(cls.responses_by_header(server, raw_request(
        json.dumps({"model": "m", "input": "1+1=", "max_output_tokens": 2}).encode(), "/rl/v1/responses",
        headers=[("x-areal-session", "hdr")])))
    assert resp.status_code == 200 and json.loads(resp.body)["object"] == "response"
    assert len(server.local.service.session("hdr")["calls"]) == 2
    gone = run(cls.unknown(server, "v1/responses/r1", raw_request(b"", "/rl/v1/responses/r1", "GET")))
    err = json.loads(gone.body)["error"]
    assert gone.status_code == 404 and err["code"] == "responses_not_stored"
    nowhere = run(cls.unknown(server, "x", raw_request(b"", "/rl/x", "GET")))
    assert nowhere.status_code == 404 and json.loads(nowhere.body)["error"]["code"] == "unknown_url"
