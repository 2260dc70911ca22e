"""The OpenAI endpoint on a real rollout Serve app behind Serve's HTTP proxy, driven by
the real `openai` client: responses parse, sessions record what was generated, a
3-turn chat is one trajectory with exact prefix reuse whose versions change after a
weight push between turns, bad requests are 400s the client raises, AgentWorkflow
returns a group of the right shape, `tools=` and a `role: tool` reply continue the
recorded session, and streamed chunks assemble to the non-streamed answer; a request
without the key is a 401, an oversized body a 413, a session past its byte budget a
400, a full store a 429, and none of them disturbs another session. The endpoint runs 2
replicas (rollout.openai.replicas=2), so all of this also crosses from the ingress to the
second: each session's calls stay on one replica, and after that replica is killed its
session is refused with a 410. One app for the module (Serve restarted with the proxy on
a free port, and shut down after, so later modules start their own)."""

import asyncio
import socket
import uuid

import httpx
import openai
import pytest
import ray
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_ray.cluster.placement import delete_app
from areal_ray.config import WeightsConfig, load_config
from areal_ray.driver import Driver
from areal_ray.rollout.openai.affinity import shard_of
from areal_ray.rollout.openai.tool_calls import new_call_id
from areal_ray.rollout.workflows.agent import AgentWorkflow
from areal_ray.rollout.workflows.base import EpisodeConfig
from areal_ray.weights.push import WeightPusher
from deployments.openai_api import OPENAI_DEPLOYMENT, REPLICA_HEADER, build_openai_app
from deployments.rollout import DEPLOYMENT_NAME, build_app
from tests.weights.test_push import perturb

PREFIX = "/rl"
KEY = "test-endpoint-key-0123456789"
MAX_REQUEST_BYTES, MAX_SESSION_BYTES, MAX_SESSIONS = 20_000, 6_000, 8
REPLICAS = 2
TOOLS = [{"type": "function", "function": {
    "name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint(ray_cluster, random_model_dir):
    tag = uuid.uuid4().hex[:6]
    driver = Driver.options(name=f"drv-{tag}").remote(eta=1, batch_groups=1, push_timeout_s=30.0)
    port = free_port()
    cfg = load_config(None, ["rollout.num_cpus=0.5", "rollout.max_new_tokens=8",
                             "rollout.openai.enabled=true", f"rollout.openai.port={port}",
                             f"rollout.openai.route_prefix={PREFIX}", f"rollout.openai.api_key={KEY}",
                             f"rollout.openai.max_request_bytes={MAX_REQUEST_BYTES}",
                             f"rollout.openai.max_session_bytes={MAX_SESSION_BYTES}",
                             f"rollout.openai.max_sessions={MAX_SESSIONS}",
                             f"rollout.openai.replicas={REPLICAS}"])
    serve.shutdown()  # the proxy is set when Serve starts: a fresh Serve with it on
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    app = f"openai-{tag}"
    rollout = build_app(cfg, random_model_dir, f"drv-{tag}", ray.get_runtime_context().namespace)
    serve.run(build_openai_app(cfg, rollout, random_model_dir), name=app, route_prefix=PREFIX)
    yield {"base": cfg.rollout.openai.base_url(), "driver": driver,
           "rollout": serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app),
           "tok": AutoTokenizer.from_pretrained(random_model_dir), "model": random_model_dir,
           "app": app}
    delete_app(app)
    serve.shutdown()
    ray.kill(driver)


AUTH = {"Authorization": f"Bearer {KEY}"}


def client(endpoint, sid, key=KEY):
    return openai.AsyncOpenAI(base_url=f"{endpoint['base']}/sessions/{sid}/v1", api_key=key,
                              max_retries=0)


def recorded(endpoint, sid) -> dict:
    res = httpx.get(f"{endpoint['base']}/sessions/{sid}", timeout=60, headers=AUTH)
    res.raise_for_status()
    return res.json()


def test_completions_and_chat_parse_and_the_session_records_them(endpoint):
    async def go():
        c = client(endpoint, "basic")
        models = await c.models.list()
        comp = await c.completions.create(model="any", prompt="12+3=", max_tokens=6, logprobs=1,
                                          extra_body={"return_token_ids": True})
        chat = await c.chat.completions.create(model="any", max_tokens=5,
                                               messages=[{"role": "user", "content": "7+8="}])
        return models, comp, chat

    models, comp, chat = asyncio.run(go())
    assert [m.id for m in models.data] == [endpoint["model"].rstrip("/").split("/")[-1]]
    tok = endpoint["tok"]
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens <= 6
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
    calls = recorded(endpoint, "basic")["calls"]
    assert calls[0]["output_ids"] == comp.choices[0].model_extra["token_ids"]
    assert calls[0]["logprobs"] == comp.choices[0].logprobs.token_logprobs
    assert calls[0]["prompt_ids"] == tok("12+3=", add_special_tokens=False)["input_ids"]
    assert comp.choices[0].text == tok.decode(calls[0]["output_ids"], skip_special_tokens=True)
    assert chat.choices[0].message.content == tok.decode(calls[1]["output_ids"], skip_special_tokens=True)
    assert calls[1]["extends"] is None  # "7+8=" does not continue the completion
    assert httpx.delete(f"{endpoint['base']}/sessions/basic", headers=AUTH).json()["deleted"] is True
    assert httpx.get(f"{endpoint['base']}/sessions/basic", headers=AUTH).status_code == 404


def test_a_chat_across_a_weight_push_is_one_trajectory(endpoint, tmp_path):
    """Turn 1 at version 0; a push; turns 2 and 3 at version 1. The prompt of each turn
    is the previous turn's exact ids plus the tool result's."""
    async def turn(messages):
        r = await client(endpoint, "chat").chat.completions.create(
            model="any", messages=messages, max_tokens=6, stop=[")"])
        return r.choices[0].message.content

    messages = [{"role": "user", "content": "12+3="}]
    for i in range(3):
        if i == 1:
            model = AutoModelForCausalLM.from_pretrained(endpoint["model"])
            perturb(model, 1)
            _, stats = WeightPusher(WeightsConfig(path="object_store"), endpoint["driver"], 0,
                                    str(tmp_path)).push(model, 1)
            assert stats["replicas"] == 1
        content = asyncio.run(turn(messages))
        messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": f"={i}"}]
    session = recorded(endpoint, "chat")
    calls, (sample,) = session["calls"], session["samples"]
    for prev, nxt in zip(calls, calls[1:]):
        history = prev["prompt_ids"] + prev["output_ids"]
        assert nxt["prompt_ids"][:len(history)] == history
    n = [len(c["output_ids"]) for c in calls]
    assert sample["loss_mask"] == [1] * n[0] + [0] * 2 + [1] * n[1] + [0] * 2 + [1] * n[2]
    assert sample["versions"] == [0] * n[0] + [-1] * 2 + [1] * n[1] + [-1] * 2 + [1] * n[2]
    assert (sample["n_turns"], sample["tool_calls"]) == (3, 2)
    close = endpoint["tok"](")", add_special_tokens=False)["input_ids"]
    for c in calls:  # `)` only ever ends an output
        assert close[0] not in c["output_ids"][:-1]


def test_bad_requests_are_400s_the_client_raises(endpoint):
    async def go(**kwargs):
        return await client(endpoint, "bad").chat.completions.create(
            model="any", messages=[{"role": "user", "content": "1+1="}], **kwargs)

    for kwargs, needle in [({"stop": ["1", "2", "3", "4", "5"]}, "at most 4"), ({"n": 17}, "n must be an integer"),
                           ({"tools": TOOLS, "tool_choice": "required"}, "'required'")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            asyncio.run(go(**kwargs))
    bad_json = httpx.post(f"{endpoint['base']}/sessions/bad/v1/completions", content=b"{",
                          headers={"content-type": "application/json", **AUTH})
    assert bad_json.status_code == 400 and "not JSON" in bad_json.json()["error"]["message"]


def test_the_agent_workflow_returns_a_group_of_group_size_samples(endpoint):
    flow = AgentWorkflow(EpisodeConfig(group_size=3, max_new_tokens=8, temperature=1.0),
                         agent="examples.calculator_agent.calculator_agent",
                         base_url=endpoint["base"], api_key=KEY)
    row = {"uid": "u", "prompt": "48+39=", "answer": "87", "verifier": "math", "pos": 0}
    group = asyncio.run(flow.arun_episode(None, row))
    assert group.uid == "u" and len(group.samples) == 3
    ids = endpoint["tok"]("48+39=", add_special_tokens=False)["input_ids"]
    for s in group.samples:
        assert s.prompt_ids == ids and len(s.loss_mask) == len(s.output_ids) == len(s.versions)
        assert s.text == endpoint["tok"].decode(s.output_ids, skip_special_tokens=True)


def test_only_requests_with_the_key_and_within_the_limits_are_served(endpoint):
    """Without the key: 401 on every route, nothing opened or generated. Too large: a
    413 by Content-Length or by what was read, a 400 past the session's byte budget;
    max_tokens past rollout.max_new_tokens is cut to it. The session beside them,
    mid-conversation, goes on undisturbed and its record is intact."""
    base, messages = endpoint["base"], [{"role": "user", "content": "3+4="}]

    async def chat(sid, key=KEY, **kwargs):
        return await client(endpoint, sid, key).chat.completions.create(
            model="any", messages=kwargs.pop("messages", messages), **kwargs)

    first = asyncio.run(chat("bystander", max_tokens=4))
    for key in ("none", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError, match="rollout.openai.api_key"):
            asyncio.run(chat("intruder", key=key))
    for method, path in [("GET", "/bystander"), ("DELETE", "/bystander"), ("POST", "/intruder"),
                         ("GET", "/bystander/v1/models")]:
        res = httpx.request(method, f"{base}/sessions{path}", json={},
                            headers={"Authorization": "Bearer nope"})
        assert res.status_code == 401 and res.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{base}/sessions/intruder", headers=AUTH).status_code == 404

    huge = "1" * (MAX_REQUEST_BYTES + 1)
    with pytest.raises(openai.APIStatusError, match="max_request_bytes") as e:
        asyncio.run(chat("huge", messages=[{"role": "user", "content": huge}]))
    assert e.value.status_code == 413

    def chunked():  # no Content-Length: refused by what was read
        for _ in range(4):
            yield b" " * (MAX_REQUEST_BYTES // 2)
    res = httpx.post(f"{base}/sessions/huge/v1/completions", content=chunked(),
                     headers={"content-type": "application/json", **AUTH})
    assert res.status_code == 413 and "max_request_bytes" in res.json()["error"]["message"]

    capped = asyncio.run(chat("capped", max_tokens=10_000))  # rollout.max_new_tokens=8
    assert capped.usage.completion_tokens <= 8 and recorded(endpoint, "capped")["calls"]
    long = [{"role": "user", "content": "1" * 230}]  # ~2.4 kB recorded per call
    for _ in range(2):
        asyncio.run(chat("long", messages=long, max_tokens=2))
    with pytest.raises(openai.BadRequestError, match="max_session_bytes"):
        asyncio.run(chat("long", messages=long, max_tokens=2))
    assert len(recorded(endpoint, "long")["calls"]) == 2
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        asyncio.run(client(endpoint, "ids").completions.create(model="any", prompt=[5, 10 ** 9]))

    turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "tool", "content": "=7"}]
    asyncio.run(chat("bystander", messages=turn2, max_tokens=4))
    calls = recorded(endpoint, "bystander")["calls"]
    assert len(calls) == 2 and calls[1]["extends"] == 0
    for sid in ("bystander", "capped", "long", "ids"):
        httpx.delete(f"{base}/sessions/{sid}", headers=AUTH)


def test_a_full_endpoint_refuses_new_sessions_and_keeps_the_live_ones(endpoint):
    """Opening sessions cannot evict a running episode's: past max_sessions live ones
    (per replica) a new one is a 429, and the held ones are all still there."""
    base, opened = endpoint["base"], []
    for i in range(REPLICAS * MAX_SESSIONS + 1):
        res = httpx.post(f"{base}/sessions/fill-{i}", json={}, headers=AUTH)
        if res.status_code != 200:
            break
        opened.append(f"fill-{i}")
    assert res.status_code == 429 and "max_sessions" in res.json()["error"]["message"]
    assert res.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= len(opened) <= REPLICAS * MAX_SESSIONS
    for sid in opened:
        assert httpx.get(f"{base}/sessions/{sid}", headers=AUTH).status_code == 200
        assert httpx.delete(f"{base}/sessions/{sid}", headers=AUTH).status_code == 200
    assert httpx.post(f"{base}/sessions/after", json={}, headers=AUTH).status_code == 200
    httpx.delete(f"{base}/sessions/after", headers=AUTH)


def test_tools_are_accepted_and_a_tool_reply_continues_the_recorded_sample(endpoint):
    """Over HTTP with the real client, on the default `hermes` parser. The random char
    model never writes a call (its alphabet cannot spell JSON strings), so its answer
    has no `tool_calls`; the reply then carries a call with the id the endpoint gives
    to a call in the session's first output (tests/rollout/openai/test_tool_calls.py parses
    real call text with a scripted engine): the client sends it and the tool result
    back, and the request continues the first call's exact ids, one Sample."""
    async def go():
        c = client(endpoint, "tools")
        messages = [{"role": "user", "content": "12+3="}]
        first = await c.chat.completions.create(model="any", messages=messages, tools=TOOLS,
                                                tool_choice="auto", max_tokens=6)
        msg = first.choices[0].message
        out = recorded(endpoint, "tools")["calls"][0]["output_ids"]
        call = {"id": new_call_id(0, 0, out), "type": "function",
                "function": {"name": "calc", "arguments": '{"expr": "12+3"}'}}
        messages += [{"role": "assistant", "content": msg.content, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "=15"}]
        second = await c.chat.completions.create(model="any", messages=messages, tools=TOOLS,
                                                 max_tokens=6)
        return first, second

    first, second = asyncio.run(go())
    assert first.choices[0].message.tool_calls is None
    assert first.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.role == "assistant"
    session = recorded(endpoint, "tools")
    c0, c1 = session["calls"]
    assert c1["extends"] == 0 and c1["prompt_ids"][:len(c0["prompt_ids"]) + len(c0["output_ids"])] \
        == c0["prompt_ids"] + c0["output_ids"]
    (sample,) = session["samples"]
    assert sample["loss_mask"] == [1] * len(c0["output_ids"]) + [0] * 3 + [1] * len(c1["output_ids"])


def test_streamed_chunks_assemble_to_the_non_streamed_answer(endpoint):
    """Greedy, so two sessions generate the same: one answers whole, one streams; the
    client's chunks concatenate to the whole answer, and the streamed call is recorded."""
    messages = [{"role": "user", "content": "48+39="}]

    async def go():
        whole = await client(endpoint, "whole").chat.completions.create(
            model="any", messages=messages, temperature=0, max_tokens=8, logprobs=True)
        stream = await client(endpoint, "streamed").chat.completions.create(
            model="any", messages=messages, temperature=0, max_tokens=8, logprobs=True,
            tools=TOOLS, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        comp = await client(endpoint, "whole").completions.create(
            model="any", prompt="7+8=", temperature=0, max_tokens=8)
        comp_stream = await client(endpoint, "streamed").completions.create(
            model="any", prompt="7+8=", temperature=0, max_tokens=8, stream=True)
        return whole, chunks, comp, [c async for c in comp_stream]

    whole, chunks, comp, comp_chunks = asyncio.run(go())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content] == [e.logprob for e in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in comp_chunks) == comp.choices[0].text
    assert comp_chunks[-1].choices[0].finish_reason == comp.choices[0].finish_reason
    calls = recorded(endpoint, "streamed")["calls"]
    assert endpoint["tok"].decode(calls[0]["output_ids"], skip_special_tokens=True) == content


def test_n_choices_are_recorded_as_samples_and_the_next_turn_continues_the_chosen_one(endpoint):
    """The real client with n=3: three choices, each its own Sample; the agent keeps the
    second and goes on, and that choice's Sample continues with the next turn."""
    sid, messages = "forks", [{"role": "user", "content": "12+3="}]

    async def go():
        c = client(endpoint, sid)
        first = await c.chat.completions.create(model="any", messages=messages, n=3, max_tokens=4)
        picked = first.choices[1].message.content
        second = await c.chat.completions.create(
            model="any", max_tokens=4,
            messages=messages + [{"role": "assistant", "content": picked}, {"role": "tool", "content": "=15"}])
        comp = await c.completions.create(model="any", prompt="7+8=", n=2, max_tokens=3)
        return first, second, comp

    first, second, comp = asyncio.run(go())
    assert [ch.index for ch in first.choices] == [0, 1, 2] and len(comp.choices) == 2
    texts = [ch.message.content for ch in first.choices]
    j = texts.index(texts[1])  # the choice continued: 1, or an earlier one with the same text
    session = recorded(endpoint, sid)
    calls = session["calls"]
    assert first.usage.completion_tokens == sum(len(c["output_ids"]) for c in calls[:3])
    assert [c["extends"] for c in calls] == [None, None, None, j, None, None]
    assert len(session["samples"]) == 5  # choices 0 and 2, choice 1 + its next turn, the 2 completions
    (continued,) = [s for s in session["samples"] if s["n_turns"] == 2]
    assert continued["output_ids"][:len(calls[j]["output_ids"])] == calls[j]["output_ids"]
    httpx.delete(f"{endpoint['base']}/sessions/{sid}", headers=AUTH)


def one_sid_per_replica() -> list[str]:
    first = {}
    for i in range(100):
        first.setdefault(shard_of(f"aff-{i}", REPLICAS), f"aff-{i}")
    return [first[k] for k in range(REPLICAS)]


def test_each_sessions_calls_stay_on_one_of_the_endpoint_replicas(endpoint):
    """Two sessions, one per replica, 6 turns each, their calls interleaved: each turn's
    answer names the same replica, the two differ, and each session is one chain."""
    sids = one_sid_per_replica()

    async def turns(sid):
        c, messages, replicas = client(endpoint, sid), [{"role": "user", "content": "12+3="}], []
        for i in range(6):
            raw = await c.chat.completions.with_raw_response.create(model="any", messages=messages,
                                                                    max_tokens=3)
            replicas.append(raw.headers[REPLICA_HEADER])
            messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                         {"role": "tool", "content": f"={i}"}]
        return replicas

    async def go():
        return await asyncio.gather(*[turns(sid) for sid in sids])

    replicas = asyncio.run(go())
    assert [len(set(r)) for r in replicas] == [1] * REPLICAS
    assert [r[0].split("#")[0] for r in replicas] == [f"{OPENAI_DEPLOYMENT}-{k}" for k in range(REPLICAS)]
    for sid in sids:
        session = recorded(endpoint, sid)
        assert len(session["calls"]) == 6 and len(session["samples"]) == 1
        httpx.delete(f"{endpoint['base']}/sessions/{sid}", headers=AUTH)


def test_a_session_whose_replica_restarted_is_refused_with_a_410(endpoint):
    """Kill the second replica's actor: Serve starts another, which holds none of the
    sessions; the next call of the session it held is a 410 naming the session (nothing
    generated or recorded), the other replica's session goes on as one chain, and after
    a delete the id opens a new session."""
    s0, s1 = one_sid_per_replica()
    messages = [{"role": "user", "content": "3+4="}]

    async def chat(sid, messages):
        raw = await client(endpoint, sid).chat.completions.with_raw_response.create(
            model="any", messages=messages, max_tokens=3)
        return raw.parse().choices[0].message.content, raw.headers[REPLICA_HEADER]

    (a0, _), (a1, held_by) = asyncio.run(chat(s0, messages)), asyncio.run(chat(s1, messages))
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{endpoint['app']}#{OPENAI_DEPLOYMENT}-1#"))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def turn2(answer):
        return messages + [{"role": "assistant", "content": answer}, {"role": "tool", "content": "=7"}]

    with pytest.raises(openai.APIStatusError) as e:  # waits for Serve's new replica
        asyncio.run(chat(s1, turn2(a1)))
    assert e.value.status_code == 410
    assert f"session {s1!r} was lost" in e.value.message and held_by in e.value.message
    lost = httpx.get(f"{endpoint['base']}/sessions/{s1}", headers=AUTH)
    assert lost.status_code == 410 and lost.headers[REPLICA_HEADER] != held_by
    asyncio.run(chat(s0, turn2(a0)))
    assert [c["extends"] for c in recorded(endpoint, s0)["calls"]] == [None, 0]
    assert httpx.delete(f"{endpoint['base']}/sessions/{s1}", headers=AUTH).status_code == 410
    asyncio.run(chat(s1, messages))  # the id is free again: a new session
    assert len(recorded(endpoint, s1)["calls"]) == 1
    for sid in (s0, s1):
        httpx.delete(f"{endpoint['base']}/sessions/{sid}", headers=AUTH)


def test_what_agent_frameworks_send_by_default_gets_an_answer_or_an_error_naming_the_change(endpoint):
    """Over HTTP through Serve's proxy: the Agents SDK's default model (the Responses
    API) runs and its calls are the session's, `client.responses.create` answers plain
    and streamed with tools; a `<prefix>/v1` base URL is a 400 naming the session URL,
    or, with the session header, that session's answer; malformed bodies and a prompt
    that cannot fit the context (by its bytes) are 400s in OpenAI's format; a seed gives
    two sessions the same tokens; `parallel_tool_calls=false` is refused by name."""
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    base = endpoint["base"]

    @function_tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        return expr

    async def go():
        c = client(endpoint, "frameworks")
        agent = Agent(name="a", tools=[calc], model=OpenAIResponsesModel(model="any", openai_client=c))
        result = await Runner.run(agent, "12+3=", run_config=RunConfig(tracing_disabled=True))
        tools = [{"type": "function", "name": "calc", "parameters": TOOLS[0]["function"]["parameters"]}]
        resp = await client(endpoint, "responses").responses.create(
            model="any", input="7+8=", tools=tools, max_output_tokens=4)
        events = [e async for e in await client(endpoint, "responses").responses.create(
            model="any", input="7+8=", tools=tools, max_output_tokens=4, stream=True)]
        bare = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="/sessions/<sid>/v1"):
            await bare.chat.completions.create(model="any", messages=[{"role": "user", "content": "1"}])
        named = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0,
                                   default_headers={"x-areal-session": "by-header"})
        by_header = await named.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "1+1="}], max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
            await c.chat.completions.create(model="any", messages=[{"role": "user", "content": "1"}],
                                            tools=TOOLS, parallel_tool_calls=False)
        seeded = [await client(endpoint, sid).completions.create(
            model="any", prompt="12+3=", max_tokens=8, temperature=1.0, seed=5,
            extra_body={"return_token_ids": True}) for sid in ("seed-a", "seed-b")]
        return result, resp, events, by_header, seeded

    result, resp, events, by_header, seeded = asyncio.run(go())
    assert isinstance(result.final_output, str) and recorded(endpoint, "frameworks")["calls"]
    calls = recorded(endpoint, "responses")["calls"]
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens <= 4
    assert resp.output_text == endpoint["tok"].decode(calls[0]["output_ids"], skip_special_tokens=True)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed",
                                                                        "response.incomplete")
    assert len(calls) == 2
    gone = httpx.get(f"{base}/sessions/responses/v1/responses/{resp.id}", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "responses_not_stored"
    assert by_header.choices[0].message.role == "assistant" and len(recorded(endpoint, "by-header")["calls"]) == 1
    a, b = (s.choices[0].model_extra["token_ids"] for s in seeded)
    assert a == b
    for data, needle in [(b'{"model": "m", "prompt": "\\udc00"}', "lone surrogate"),
                         (b"[" * 9_000 + b"]" * 9_000, "nested too deeply"),
                         (b'{"model": "m", "prompt": "\xfe"}', "not UTF-8")]:
        res = httpx.post(f"{base}/sessions/malformed/v1/completions", content=data,
                         headers={"content-type": "application/json", **AUTH})
        assert res.status_code == 400 and needle in res.json()["error"]["message"]
        assert res.json()["error"]["type"] == "invalid_request_error"
    big = "1" * (MAX_REQUEST_BYTES - 1000)  # under the byte cap, past any tokenization of the context
    res = httpx.post(f"{base}/sessions/big/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "m", "messages": [{"role": "tool", "content": big}]})
    assert res.status_code == 400 and res.json()["error"]["code"] == "context_length_exceeded"
    assert "bytes, at least" in res.json()["error"]["message"]
    assert httpx.get(f"{base}/nowhere", headers=AUTH).json()["error"]["code"] == "unknown_url"
    for sid in ("by-header", "seed-a", "seed-b", "frameworks", "responses", "big"):
        httpx.delete(f"{base}/sessions/{sid}", headers=AUTH)
