"""The OpenAI-compatible endpoint: a FastAPI ingress in the rollout Serve app, so agent
code written against the `openai` client runs unchanged as a rollout workflow.

    POST   <prefix>/sessions/{sid}/v1/completions
    POST   <prefix>/sessions/{sid}/v1/chat/completions
    GET    <prefix>/sessions/{sid}/v1/models
    GET    <prefix>/sessions/{sid}          the recorded calls and the Samples they make
    DELETE <prefix>/sessions/{sid}

`openai.AsyncOpenAI(base_url=".../sessions/<sid>/v1", api_key=<rollout.openai.api_key>)`
is all an agent needs. Every route first checks the bearer key and the body's size
(areal_ray/rollout/openai/auth.py: a 401 or 413 before the body is read or parsed). Every call of a session is recorded token by token (areal_ray/rollout/openai/sessions.py)
and generated through the Rollout deployment's handle (an `EngineClient`: a lost
replica is retried) with interruptible resubmission, so a weight push never reaches the
agent and every token keeps the version that sampled it
(areal_ray/rollout/openai/service.py does the work; this module maps routes onto it).

One replica, on purpose: sessions live in the replica's memory, and Serve's HTTP proxy
has no session affinity, so a second replica would see half of each session's calls.
The replica only renders, tokenizes and waits on the Rollout replicas, which do the
generating; one is not a bottleneck at the request rates of CPU and single-node GPU
runs. Memory is bounded by `rollout.openai.max_sessions` live sessions of at most
`max_session_bytes` each, and `session_ttl_s`.

The app's ingress is then this deployment: the training pipeline keeps calling the
Rollout deployment by name (`serve.get_deployment_handle(DEPLOYMENT_NAME, app)`).
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.engines.limits import RequestLimits
from areal_ray.rollout.openai.auth import RequestGuard
from areal_ray.rollout.openai.protocol import APIError, Defaults
from areal_ray.rollout.openai.service import OpenAIService
from areal_ray.rollout.openai.sessions import SessionStore
from areal_ray.rollout.openai.sse import EventStream

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
    api_key: str = ""
    max_request_bytes: int = 8 << 20
    max_session_bytes: int | None = None
    tool_parser: str = "none"  # rollout.openai.tool_parser: vLLM's tool parser by name

    def __repr__(self) -> str:  # Serve logs its deployments' init args: never the key
        return f"EndpointOptions(max_sessions={self.max_sessions}, api_key=<redacted>)"

    @classmethod
    def from_config(cls, rollout) -> EndpointOptions:
        """From the run's `rollout` section (`RolloutConfig`: the endpoint reads nothing
        else). Needs the key: the run makes one when rollout.openai.api_key is empty
        (agent_workflow.resolve_endpoint), so its workflow gets the same."""
        o, kw = rollout.openai, rollout.engine_kwargs or {}
        if not o.api_key:
            raise ValueError("rollout.openai.api_key is empty: resolve_endpoint(cfg) makes the "
                             "run's key before the endpoint is built")
        return cls(o.max_sessions, o.session_ttl_s, rollout.max_new_tokens,
                   rollout.temperature, next((kw[k] for k in CONTEXT_ARGS if kw.get(k)), None),
                   o.api_key, o.max_request_bytes, o.max_session_bytes, o.tool_parser)


async def _answer(fn, *args) -> JSONResponse:
    """The JSON of `fn(*args)` (awaited when a coroutine; server-sent events when it is
    an `EventStream`), or OpenAI's error body with the status."""
    try:
        got = fn(*args)
        result = await got if inspect.isawaitable(got) else got
        return result.response() if isinstance(result, EventStream) else JSONResponse(result)
    except APIError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except Exception as e:  # noqa: BLE001 - the agent gets a 500 with the reason, the replica lives on
        logger.exception("OpenAI endpoint request failed")
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}").body(), status_code=500)


async def _body(guard: RequestGuard, request: Request) -> dict:
    """The JSON body, its size checked before it is read (declared) and while (read)."""
    guard.check_length(request.headers.get("content-length"))
    data = await guard.read(request.stream())
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not JSON: {e}") from e


# Helpers above the class: `serve.ingress` pickles the FastAPI app by value when it
# decorates, so what its routes call must already exist then.
@serve.deployment(name=OPENAI_DEPLOYMENT)
@serve.ingress(api)
class OpenAIServer:
    def __init__(self, rollout, model_path: str, opts: EndpointOptions):
        from areal_ray.rollout.openai.tool_calls import ToolCallParser
        from areal_ray.task.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(model_path)
        self.guard = RequestGuard(opts.api_key, opts.max_request_bytes)
        self.service = OpenAIService(
            tokenizer, EngineClient(rollout), Defaults(opts.max_tokens, opts.temperature),
            SessionStore(opts.max_sessions, opts.session_ttl_s, max_session_bytes=opts.max_session_bytes),
            model_name=Path(model_path).name,
            limits=RequestLimits.from_pretrained(model_path, opts.max_model_len),
            max_tokens_cap=opts.max_tokens,
            tool_parser=None if opts.tool_parser == "none" else ToolCallParser(opts.tool_parser, tokenizer))

    async def _serve(self, request: Request, method, *args, body: bool = False) -> JSONResponse:
        """`method(*args[, the JSON body])`, for a request with the key (401 without)."""
        try:
            self.guard.authorize(request.headers.get("authorization"))
            if body:
                args = (*args, await _body(self.guard, request))
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return await _answer(method, *args)

    @api.post("/sessions/{sid}/v1/completions")
    async def completions(self, sid: str, request: Request) -> JSONResponse:
        return await self._serve(request, self.service.completions, sid, body=True)

    @api.post("/sessions/{sid}/v1/chat/completions")
    async def chat_completions(self, sid: str, request: Request) -> JSONResponse:
        return await self._serve(request, self.service.chat, sid, body=True)

    @api.get("/sessions/{sid}/v1/models")
    async def models(self, sid: str, request: Request) -> JSONResponse:
        return await self._serve(request, self.service.models)

    @api.post("/sessions/{sid}")
    async def open_session(self, sid: str, request: Request) -> JSONResponse:
        return await self._serve(request, self.service.open_session, sid, body=True)

    @api.get("/sessions/{sid}")
    async def session(self, sid: str, request: Request) -> JSONResponse:
        return await self._serve(request, self.service.session, sid)

    @api.delete("/sessions/{sid}")
    async def delete(self, sid: str, request: Request) -> JSONResponse:
        return await self._serve(request, self.service.delete, sid)


def build_openai_app(cfg, rollout_app, model_path: str):
    """The endpoint over `rollout_app` (deployments.rollout.build_app): one replica (see
    the module docstring), no CPU reserved (it waits on the Rollout replicas)."""
    return OpenAIServer.options(
        num_replicas=1, max_ongoing_requests=cfg.rollout.openai.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False},
    ).bind(rollout_app, model_path, EndpointOptions.from_config(cfg.rollout))
