"""AgentWorkflow without Ray: the example calculator agent, through the real `openai`
client, against the endpoint's request handling on an in-process engine (HTTP is an
httpx mock transport); one Sample per session; rows rejected when an agent returns
None or a session does not chain under multi_sample=reject; an agent that never returns,
abandoned at the episode deadline, still has its sessions deleted; the run's URL wiring."""

import asyncio
import json
import re

import httpx
import pytest
import torch

from areal_ray.config import ConfigError, load_config
from areal_ray.data.pipeline import LATE, before_deadline
from areal_ray.plugins import PluginError
from areal_ray.rollout.openai.protocol import APIError
from areal_ray.rollout.workflows.agent import AgentWorkflow, pick_sample, resolve_endpoint
from areal_ray.rollout.workflows.base import EpisodeConfig
from areal_ray.types import Sample
from tests.rollout.openai.test_service import engine, service  # noqa: F401 - fixture

ROW = {"uid": "u1", "prompt": "4821+3907=", "answer": "8728", "verifier": "math", "pos": 0}
AGENT = "examples.calculator_agent.calculator_agent"
BASE = "http://endpoint/areal"
KEY = "agent-key-0123456789"


def transport(svc) -> httpx.MockTransport:
    """Routes of deployments/openai_api.py onto the service."""
    async def handle(request: httpx.Request) -> httpx.Response:
        # every request, the agent's and the workflow's own, carries the run's key
        assert request.headers.get("authorization") == f"Bearer {KEY}", request.url
        m = re.fullmatch(r"/areal/sessions/([^/]+)(/v1/.*)?", request.url.path)
        sid, route = m.group(1), m.group(2)
        try:
            if route == "/v1/chat/completions":
                body = await svc.chat(sid, json.loads(request.content))
            elif route == "/v1/completions":
                body = await svc.completions(sid, json.loads(request.content))
            elif request.method == "DELETE":
                body = svc.delete(sid)
            elif request.method == "POST":
                body = svc.open_session(sid, json.loads(request.content))
            else:
                body = svc.session(sid)
        except APIError as e:
            return httpx.Response(e.status, json=e.body())
        return httpx.Response(200, json=body)
    return httpx.MockTransport(handle)


class MockedAgentWorkflow(AgentWorkflow):
    svc = None

    def http(self):
        if self._http is None:
            self._http = httpx.AsyncClient(transport=transport(self.svc))
        return self._http


def workflow(svc, group_size=3, temperature=1.0, **kwargs):
    MockedAgentWorkflow.svc = svc
    return MockedAgentWorkflow(EpisodeConfig(group_size, 8, temperature), base_url=BASE,
                               api_key=KEY, **kwargs)


async def none_agent(client, row):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
    return None


async def forking_agent(client, row):
    """Two calls that do not chain: the second prompt rewrites the first."""
    for prompt in ("12", "34"):
        await client.completions.create(model="m", prompt=prompt, max_tokens=2)
    return "done"


def test_the_calculator_agent_gives_one_sample_per_session(engine):  # noqa: F811
    torch.manual_seed(0)
    svc = service(engine)
    group = asyncio.run(workflow(svc, agent=AGENT).arun_episode(None, ROW))
    assert (group.uid, group.prompt, group.answer) == ("u1", "4821+3907=", "8728")
    assert len(group.samples) == 3
    prompt_ids = engine.tokenizer("4821+3907=", add_special_tokens=False)["input_ids"]
    for s in group.samples:
        assert s.prompt_ids == prompt_ids
        assert len(s.loss_mask) == len(s.output_ids) == len(s.logprobs) == len(s.versions)
        assert s.loss_mask[:1] == [1] and s.n_turns == s.tool_calls + 1
        assert all((m == 0) == (v == -1) for m, v in zip(s.loss_mask, s.versions))
        # the agent's transcript is the decoded trajectory (model text and tool results)
        assert s.text == engine.tokenizer.decode(s.output_ids, skip_special_tokens=True)
    assert len(svc.store) == 0  # every session was deleted


def test_the_episodes_sampling_settings_are_the_sessions_defaults(engine):  # noqa: F811
    """The calculator agent sends no temperature: an evaluation's episode (temperature
    0) must decode greedily through the endpoint, so its sessions agree token for token."""
    torch.manual_seed(0)
    svc = service(engine)
    greedy = asyncio.run(workflow(svc, 4, temperature=0.0, agent=AGENT).arun_episode(None, ROW))
    assert len({tuple(s.output_ids) for s in greedy.samples}) == 1
    sampled = asyncio.run(workflow(svc, 4, agent=AGENT).arun_episode(None, ROW))
    assert len({tuple(s.output_ids) for s in sampled.samples}) > 1
    with pytest.raises(APIError, match="unknown session settings"):
        svc.open_session("s", {"top_p": 0.5})
    with pytest.raises(APIError, match="temperature"):
        svc.open_session("s", {"temperature": 3})


def test_rows_are_rejected_when_an_agent_returns_none_or_a_session_forks(engine):  # noqa: F811
    svc = service(engine)
    assert asyncio.run(workflow(svc, agent=f"{__name__}.none_agent").arun_episode(None, ROW)) is None
    forked = asyncio.run(workflow(svc, 2, agent=f"{__name__}.forking_agent",
                                  multi_sample="reject").arun_episode(None, ROW))
    assert forked is None
    kept = asyncio.run(workflow(svc, 2, agent=f"{__name__}.forking_agent").arun_episode(None, ROW))
    ids34 = engine.tokenizer("34", add_special_tokens=False)["input_ids"]
    assert [s.prompt_ids for s in kept.samples] == [ids34, ids34]  # the last chain of each
    assert len(svc.store) == 0


async def hanging_agent(client, row):
    await client.completions.create(model="m", prompt="12", max_tokens=2)
    await asyncio.sleep(1e6)


def test_an_agent_abandoned_at_the_deadline_leaves_no_session(engine):  # noqa: F811
    svc = service(engine)
    flow = workflow(svc, 2, agent=f"{__name__}.hanging_agent")

    async def scenario():
        left = set()
        got = await before_deadline(flow.arun_episode(None, ROW), 1.0, left)
        opened = len(svc.store)
        while left:  # the abandoned episode unwinds: its `finally` deletes the sessions
            await asyncio.sleep(0.01)
        return got, opened
    got, opened = asyncio.run(scenario())
    assert got is LATE and opened == 2 and len(svc.store) == 0


def test_pick_sample():
    a, b = (Sample([1], [2], [0.0], [0], "stop") for _ in range(2))
    assert pick_sample([a, b], "last") is b and pick_sample([a], "reject") is a
    assert pick_sample([a, b], "reject") is None and pick_sample([], "last") is None


def test_the_run_fills_in_the_endpoint_url_and_key():
    flow = ["rollout.workflow=areal_ray.rollout.workflows.agent.AgentWorkflow",
            f"rollout.workflow_kwargs={{agent: {AGENT}}}"]
    cfg = load_config(None, flow + ["rollout.openai.enabled=true", "rollout.openai.port=8123",
                                    "rollout.openai.route_prefix=/rl"])
    resolve_endpoint(cfg)
    assert cfg.rollout.workflow_kwargs == {"agent": AGENT, "base_url": "http://127.0.0.1:8123/rl",
                                           "api_key": cfg.rollout.openai.api_key}
    assert len(cfg.rollout.openai.api_key) >= 40  # made for the job (more: test_endpoint_auth.py)
    with pytest.raises(ConfigError, match="rollout.openai.enabled=true"):
        resolve_endpoint(load_config(None, flow))
    given = load_config(None, flow[:1] + [f"rollout.workflow_kwargs={{agent: {AGENT}, base_url: 'http://x:1'}}"])
    resolve_endpoint(given)
    assert given.rollout.workflow_kwargs["base_url"] == "http://x:1"
    with pytest.raises(PluginError, match="rollout.workflow_kwargs.agent 'examples.nope.agent'"):
        resolve_endpoint(load_config(None, flow[:1] + ["rollout.workflow_kwargs={agent: examples.nope.agent}",
                                                       "rollout.openai.enabled=true"]))
    resolve_endpoint(load_config(None, []))  # the single-turn workflow takes no URL



def test_a_session_the_endpoint_lost_rejects_the_row(engine):  # noqa: F811
    """A 410 (the endpoint replica holding a session restarted) on an agent's call or on
    the fetch of its Samples: the row is rejected, not the run failed."""
    from areal_ray.rollout.openai.affinity import SessionLost
    svc, calls = service(engine), []
    chat, session = svc.chat, svc.session

    async def lose_the_second(sid, body):
        calls.append(sid)
        if len(calls) == 2:
            raise SessionLost(sid, "OpenAI-1#dead")
        return await chat(sid, body)
    svc.chat = lose_the_second
    assert asyncio.run(workflow(svc, 2, agent=AGENT).arun_episode(None, ROW)) is None
    svc.chat = chat

    def lost_fetch(sid):
        raise SessionLost(sid, "OpenAI-1#dead")
    svc.session = lost_fetch
    assert asyncio.run(workflow(svc, 2, agent=AGENT).arun_episode(None, ROW)) is None
    svc.session = session
    assert len(svc.store) == 0


async def rambling_agent(client, row):
    """A second turn whose history no longer fits the model's context."""
    first = await client.completions.create(model="m", prompt="12", max_tokens=2)
    await client.completions.create(model="m", prompt="12" + first.choices[0].text + "3" * 40,
                                    max_tokens=2)
    return "never reached"


def test_a_session_that_outgrows_the_context_trains_as_no_answer(engine):  # noqa: F811
    """The endpoint's 400 `context_length_exceeded` ends that session's episode (the
    model filled its context, the agent is not broken): the group still trains, each
    session's recorded turns graded as the empty answer; any other 400 fails the
    episode as before."""
    import openai

    from areal_ray.rollout.engines.limits import RequestLimits
    svc = service(engine, limits=RequestLimits(None, 24))
    group = asyncio.run(workflow(svc, 2, agent=f"{__name__}.rambling_agent").arun_episode(None, ROW))
    assert [s.text for s in group.samples] == ["", ""]
    assert all(s.n_turns == 1 and len(s.output_ids) >= 1 for s in group.samples)
    assert len(svc.store) == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        asyncio.run(workflow(svc, 2, agent=f"{__name__}.zero_budget_agent").arun_episode(None, ROW))


async def zero_budget_agent(client, row):
    await client.completions.create(model="m", prompt="12", max_tokens=0)
    return "x"


def test_a_session_open_waits_out_an_endpoint_replica_being_replaced(engine, monkeypatch):  # noqa: F811
    """A 5xx on opening a session (the endpoint replica crashed and Serve is replacing
    it: an evaluation right after training once failed so) is tried again; one that
    stays down fails the episode with the endpoint's message after the last wait."""
    from areal_ray.rollout.workflows import agent as agent_module
    from areal_ray.rollout.workflows.agent import EndpointRefused
    monkeypatch.setattr(agent_module, "OPEN_RETRY_S", (0.01, 0.01))
    svc, opened = service(engine), []
    open_session = svc.open_session

    def flaky(sid, body):
        opened.append(sid)
        if len(opened) <= 2:
            raise APIError(503, "replica down")
        return open_session(sid, body)
    svc.open_session = flaky
    group = asyncio.run(workflow(svc, 1, agent=AGENT).arun_episode(None, ROW))
    assert len(group.samples) == 1 and len(opened) == 3 and len(set(opened)) == 1

    def down(sid, body):
        raise APIError(500, "replica down")
    svc.open_session = down
    with pytest.raises(EndpointRefused, match="500 replica down"):
        asyncio.run(workflow(svc, 1, agent=AGENT).arun_episode(None, ROW))


def test_an_endpoint_refusal_fails_the_episode_with_its_message(engine):  # noqa: F811
    """A group larger than the endpoint's room: the 429 names rollout.openai.max_sessions
    (a config to fix, so the episode fails); every session opened is still deleted."""
    from areal_ray.rollout.workflows.agent import EndpointRefused
    svc = service(engine)
    svc.store.max_sessions = 2
    with pytest.raises(EndpointRefused, match="429 .*rollout.openai.max_sessions"):
        asyncio.run(workflow(svc, 3, agent=AGENT).arun_episode(None, ROW))
    assert len(svc.store) == 0
