"""The OpenAI-compatible endpoint: a FastAPI ingress in the rollout Serve app, so agent
code written against the `openai` client runs unchanged as a rollout workflow.

    POST   <prefix>/sessions/{sid}/v1/completions
    POST   <prefix>/sessions/{sid}/v1/chat/completions
    GET    <prefix>/sessions/{sid}/v1/models
    GET    <prefix>/sessions/{sid}          the recorded calls and the Samples they make
    DELETE <prefix>/sessions/{sid}

`openai.AsyncOpenAI(base_url=".../sessions/<sid>/v1", api_key="none")` is all an agent
needs. Every call of a session is recorded token by token (areal_ray/rollout/sessions.py)
and generated through the Rollout deployment's handle (an `EngineClient`: a lost
replica is retried) with interruptible resubmission, so a weight push never reaches the
agent and every token keeps the version that sampled it
(areal_ray/rollout/openai_service.py does the work; this module maps routes onto it).

One replica, on purpose: sessions live in the replica's memory, and Serve's HTTP proxy
has no session affinity, so a second replica would see half of each session's calls.
The replica only renders, tokenizes and waits on the Rollout replicas, which do the
generating; one is not a bottleneck at the request rates of CPU and single-node GPU
runs. Memory is bounded by `rollout.openai.max_sessions` and `session_ttl_s`.

The app's ingress is then this deployment: the training pipeline keeps calling the
Rollout deployment by name (`serve.get_deployment_handle(DEPLOYMENT_NAME, app)`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.limits import RequestLimits
from areal_ray.rollout.openai_protocol import APIError, Defaults
from areal_ray.rollout.openai_service import OpenAIService
from areal_ray.rollout.sessions import SessionStore
from areal_ray.rollout.sse import EventStream

logger = logging.getLogger("ray.serve")

OPENAI_DEPLOYMENT = "OpenAI"
api = FastAPI(title="areal-ray OpenAI-compatible rollout endpoint")


# The engine arguments that set an engine's context below the model config's
# (vLLM's and HFEngine's max_model_len, sglang's context_length).
CONTEXT_ARGS = ("max_model_len", "context_length")


@dataclass
class EndpointOptions:
    max_sessions: int
    session_ttl_s: float
    max_tokens: int  # default and most max_tokens: rollout.max_new_tokens
    temperature: float  # default temperature: rollout.temperature
    max_model_len: int | None = None  # the engines' context, when set below the model's
    tool_parser: str = "none"  # rollout.openai.tool_parser: vLLM's tool parser by name

    @classmethod
    def from_config(cls, cfg) -> EndpointOptions:
        o, kw = cfg.rollout.openai, cfg.rollout.engine_kwargs or {}
        return cls(o.max_sessions, o.session_ttl_s, cfg.rollout.max_new_tokens,
                   cfg.rollout.temperature, next((kw[k] for k in CONTEXT_ARGS if kw.get(k)), None),
                   tool_parser=o.tool_parser)


async def _answer(work) -> JSONResponse:
    """The JSON of awaitable `work` (server-sent events when it is an `EventStream`), or
    OpenAI's error body with the status."""
    try:
        result = await work
        return result.response() if isinstance(result, EventStream) else JSONResponse(result)
    except APIError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except Exception as e:  # noqa: BLE001 - the agent gets a 500 with the reason, the replica lives on
        logger.exception("OpenAI endpoint request failed")
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}").body(), status_code=500)


async def _body(request: Request) -> dict:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not JSON: {e}") from e


async def _call(fn, *args):
    return fn(*args)


def _sync(fn):
    """`fn` as the coroutine function `_with_body` awaits."""
    return lambda *args: _call(fn, *args)


# Helpers above the class: `serve.ingress` pickles the FastAPI app by value when it
# decorates, so what its routes call must already exist then.
@serve.deployment(name=OPENAI_DEPLOYMENT)
@serve.ingress(api)
class OpenAIServer:
    def __init__(self, rollout, model_path: str, opts: EndpointOptions):
        from areal_ray.rollout.tool_calls import ToolCallParser
        from areal_ray.task.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(model_path)
        self.service = OpenAIService(
            tokenizer, EngineClient(rollout), Defaults(opts.max_tokens, opts.temperature),
            SessionStore(opts.max_sessions, opts.session_ttl_s), model_name=Path(model_path).name,
            limits=RequestLimits.from_pretrained(model_path, opts.max_model_len),
            max_tokens_cap=opts.max_tokens,
            tool_parser=None if opts.tool_parser == "none" else ToolCallParser(opts.tool_parser, tokenizer))

    async def _with_body(self, method, sid: str, request: Request) -> JSONResponse:
        try:
            body = await _body(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return await _answer(method(sid, body))

    @api.post("/sessions/{sid}/v1/completions")
    async def completions(self, sid: str, request: Request) -> JSONResponse:
        return await self._with_body(self.service.completions, sid, request)

    @api.post("/sessions/{sid}/v1/chat/completions")
    async def chat_completions(self, sid: str, request: Request) -> JSONResponse:
        return await self._with_body(self.service.chat, sid, request)

    @api.get("/sessions/{sid}/v1/models")
    async def models(self, sid: str) -> JSONResponse:
        return await _answer(_call(self.service.models))

    @api.post("/sessions/{sid}")
    async def open_session(self, sid: str, request: Request) -> JSONResponse:
        return await self._with_body(_sync(self.service.open_session), sid, request)

    @api.get("/sessions/{sid}")
    async def session(self, sid: str) -> JSONResponse:
        return await _answer(_call(self.service.session, sid))

    @api.delete("/sessions/{sid}")
    async def delete(self, sid: str) -> JSONResponse:
        return await _answer(_call(self.service.delete, sid))


def build_openai_app(cfg, rollout_app, model_path: str):
    """The endpoint over `rollout_app` (deployments.rollout.build_app): one replica (see
    the module docstring), no CPU reserved (it waits on the Rollout replicas)."""
    return OpenAIServer.options(
        num_replicas=1, max_ongoing_requests=cfg.rollout.openai.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False},
    ).bind(rollout_app, model_path, EndpointOptions.from_config(cfg))
