"""`AgentWorkflow`: agent code written against the `openai` client, as a rollout workflow.

The agent is any `async def agent(client: openai.AsyncOpenAI, row: dict) -> str | None`
named by dotted path (`rollout.workflow_kwargs.agent`). Per dataset row the workflow
runs `group_size` sessions of it at once, each with a fresh session id and its own
client pointed at `<base_url>/sessions/<sid>/v1` (the endpoint of
deployments/openai_api.py, on the rollout Serve app). The endpoint records every call
token by token; afterwards the workflow fetches each session's Samples
(`GET <base_url>/sessions/<sid>`), deletes the session, and sets each Sample's `text`
to what the agent returned: that is what the reward checker grades.

Group shape. The trainer wants `group_size` samples per group (the advantage code
stacks them), so each session must give exactly one Sample. A session whose calls do
not all chain (the agent rewrote its history, or made calls that do not continue each
other) gives several; `multi_sample` decides: "last" (the default) keeps the chain that
holds the session's last call, the one that wrote the final answer the reward grades,
and drops the others; "reject" rejects the row. A session that made no call, or an
agent that returns None, rejects the row (None: the rollout stage records the row as
rejected and the run reads more prompts). An agent that raises fails the episode, as
any workflow error does: a broken agent should stop the run, not starve it. An agent
that never returns is abandoned at `rollout.episode_timeout_s` (its row rejected; the
cancellation still deletes its sessions). A session the endpoint lost (410: the
endpoint replica holding it restarted, deployments/openai_api.py) rejects the row too,
whether the agent's call or the fetch of its Samples is refused: the cluster lost a
process, the agent is not broken, and what was recorded is gone. A session whose
conversation outgrew the model's context (the endpoint's 400 with OpenAI's code
`context_length_exceeded`: the model's turns and tool results filled it) ends there,
as a tool episode ends when no room is left: the agent did not answer, so its Sample
(what the session recorded) is graded as the empty answer, and trains with that
reward; the model wrote itself out of room, not the agent's code broke.

The clients do not retry (`max_retries=0`): a retried completion whose first attempt
did finish would be recorded twice and break the session's chain. The endpoint already
retries a lost rollout replica, and resubmits generations a weight push aborted.

URL and key: `base_url` and `api_key` from `rollout.workflow_kwargs`, or, left empty,
filled in by the run from `rollout.openai` (`resolve_endpoint`, called before Ray
starts; it also makes the per-job key when `rollout.openai.api_key` is empty). The key
goes on every request: the agent's client sends it as its `api_key`, and the
workflow's own calls (open, fetch, delete a session) as the same bearer header.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from typing import TYPE_CHECKING

from areal_ray.config import ConfigError
from areal_ray.plugins import import_function
from areal_ray.rollout.openai.protocol import CONTEXT_LENGTH_EXCEEDED
from areal_ray.rollout.workflows.base import EpisodeConfig, group_of, workflow_class
from areal_ray.types import Group, Sample

if TYPE_CHECKING:
    from areal_ray.rollout.engine_client import EngineClient

AGENT_KEY = "rollout.workflow_kwargs.agent"
SESSION_LOST = 410  # the endpoint's status for a session its restarted replica held
NO_ANSWER = ""  # what a session that ran out of context answered: graded as no answer
TRANSIENT = {500, 502, 503, 504}  # a session open answered so is tried again after a wait
OPEN_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0)
MULTI_SAMPLE = ("last", "reject")


def import_agent(path: str):
    return import_function(path, AGENT_KEY, coroutine=True)


def pick_sample(samples: list[Sample], multi_sample: str) -> Sample | None:
    """The one Sample a session trains (see the module docstring); None rejects the row."""
    if not samples or (len(samples) > 1 and multi_sample == "reject"):
        return None
    return samples[-1]


class EndpointRefused(RuntimeError):
    """The endpoint refused the workflow's own call; the message is the endpoint's."""


def _check(res) -> None:
    """Raise EndpointRefused with the endpoint's own message (a 401 names the key, a
    429 `rollout.openai.max_sessions`), not just the status line."""
    if res.is_success:
        return
    try:
        message = res.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not the endpoint's error body: its text
        message = res.text[:500]
    raise EndpointRefused(f"{res.request.method} {res.request.url.path}: {res.status_code} {message}")


class AgentWorkflow:
    def __init__(self, config: EpisodeConfig, agent: str, base_url: str = "",
                 multi_sample: str = "last", timeout_s: float = 600.0, api_key: str = ""):
        if not base_url:
            raise ValueError("AgentWorkflow needs base_url: set rollout.openai.enabled=true (the "
                             "run passes the endpoint's URL) or rollout.workflow_kwargs.base_url")
        if multi_sample not in MULTI_SAMPLE:
            raise ValueError(f"multi_sample must be one of {MULTI_SAMPLE}, got {multi_sample!r}")
        self.config, self.agent = config, import_agent(agent)
        self.base_url, self.multi_sample, self.timeout_s = base_url.rstrip("/"), multi_sample, timeout_s
        self.api_key = api_key or "none"  # the openai client wants one; an endpoint of another's may not
        self._http, self._loop = None, None

    def __repr__(self) -> str:  # never the key
        return f"AgentWorkflow(agent={self.agent.__name__!r}, base_url={self.base_url!r})"

    def http(self):
        """One HTTP connection pool for all sessions of this event loop's episodes."""
        import httpx
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            self._http = httpx.AsyncClient(timeout=self.timeout_s,
                                           limits=httpx.Limits(max_connections=None))
            self._loop = loop
        return self._http

    def client(self, sid: str):
        import openai
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/sessions/{sid}/v1", api_key=self.api_key,
                                  http_client=self.http(), max_retries=0, timeout=self.timeout_s)

    async def _run_agent(self, sid: str, row: dict) -> str | None:
        answer = await self.agent(self.client(sid), dict(row))
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"agent {self.agent.__module__}.{self.agent.__name__} returned "
                            f"{type(answer).__name__}: it must return the answer text or None")
        return answer

    def _auth(self) -> dict:
        """The workflow's own calls carry the key as the agent's client does."""
        return {"Authorization": f"Bearer {self.api_key}"}

    async def _open(self, sid: str) -> None:
        """Opening is idempotent (it sets the session's defaults), so an endpoint replica
        that is down for a moment (a crash Serve is replacing: 5xx, or no connection) is
        waited out for up to ~15 s instead of failing the episode."""
        import httpx
        body = {"temperature": self.config.temperature, "max_tokens": self.config.max_new_tokens}
        for wait_s in (*OPEN_RETRY_S, None):
            try:
                res = await self.http().post(f"{self.base_url}/sessions/{sid}",
                                             headers=self._auth(), json=body)
                if res.status_code not in TRANSIENT or wait_s is None:
                    return _check(res)
            except httpx.TransportError:
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)

    async def _samples(self, sid: str) -> list[Sample] | None:
        """The session's Samples; None when the endpoint lost it."""
        res = await self.http().get(f"{self.base_url}/sessions/{sid}", headers=self._auth())
        if res.status_code == 404:  # the agent made no call
            return []
        if res.status_code == SESSION_LOST:
            return None
        _check(res)
        return [Sample(**s) for s in res.json()["samples"]]

    async def _delete(self, sid: str) -> None:
        try:
            await self.http().delete(f"{self.base_url}/sessions/{sid}", headers=self._auth())
        except Exception:  # noqa: BLE001 - the endpoint drops idle sessions anyway
            pass

    async def arun_episode(self, client: EngineClient, row: dict) -> Group | None:
        """`client` (the engine client) is unused: the agent generates over HTTP."""
        sids = [uuid.uuid4().hex for _ in range(self.config.group_size)]
        try:
            # The episode's sampling settings are the sessions' defaults: agent code that
            # leaves temperature out samples in training and decodes greedily in eval.
            await asyncio.gather(*[self._open(sid) for sid in sids])
            # Every agent ends before the sessions are deleted (one that raised does
            # not leave the others writing into deleted sessions); the first error wins.
            answers = await asyncio.gather(*[self._run_agent(sid, row) for sid in sids],
                                           return_exceptions=True)
            for i, a in enumerate(answers):
                if isinstance(a, BaseException):
                    status = getattr(a, "status_code", None)  # openai.APIStatusError
                    if status == SESSION_LOST:
                        return None
                    if status == 400 and getattr(a, "code", None) == CONTEXT_LENGTH_EXCEEDED:
                        answers[i] = NO_ANSWER
                        continue
                    raise a
            if any(a is None for a in answers):
                return None
            picked = [None if s is None else pick_sample(s, self.multi_sample)
                      for s in await asyncio.gather(*[self._samples(sid) for sid in sids])]
            if any(s is None for s in picked):
                return None
            for s, answer in zip(picked, answers):
                s.text = answer
            return group_of(row, picked)
        finally:
            await asyncio.gather(*[self._delete(sid) for sid in sids])


def resolve_endpoint(cfg) -> None:
    """Before Ray starts: with the endpoint on, its key (a random one per job when
    `rollout.openai.api_key` is empty: never printed, redacted in config records). A
    workflow whose constructor takes `base_url`, left unset in `rollout.workflow_kwargs`,
    gets the endpoint's URL from `rollout.openai` (a ConfigError when the endpoint is
    off), and one that takes `api_key`, left unset, the endpoint's key; an
    AgentWorkflow's agent path is imported (PluginError naming the key)."""
    from areal_ray.rollout.openai.auth import new_api_key
    endpoint = cfg.rollout.openai
    if endpoint.enabled and not endpoint.api_key:
        endpoint.api_key = new_api_key()
    cls = workflow_class(cfg.rollout.workflow)
    kwargs = dict(cfg.rollout.workflow_kwargs)
    if issubclass(cls, AgentWorkflow) and "agent" in kwargs:
        import_agent(kwargs["agent"])
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    if "base_url" in params and not kwargs.get("base_url"):
        if not endpoint.enabled:
            raise ConfigError(f"rollout.workflow {cfg.rollout.workflow!r} talks to the OpenAI endpoint: "
                              "set rollout.openai.enabled=true (the run passes its URL as base_url) "
                              "or rollout.workflow_kwargs.base_url")
        import ray
        kwargs["base_url"] = endpoint.base_url(ray.util.get_node_ip_address())
    if "api_key" in params and not kwargs.get("api_key") and endpoint.enabled:
        kwargs["api_key"] = endpoint.api_key
    cfg.rollout.workflow_kwargs = kwargs
