"""The OpenAI-compatible endpoint: a FastAPI ingress in the rollout Serve app, so agent
code written against the `openai` client runs unchanged as a rollout workflow.

    POST   <prefix>/sessions/{sid}/v1/completions
    POST   <prefix>/sessions/{sid}/v1/chat/completions
    POST   <prefix>/sessions/{sid}/v1/responses   the Responses API, recorded as chat calls
    GET    <prefix>/sessions/{sid}/v1/models
    POST   <prefix>/v1/chat/completions, .../completions, .../responses   with the session id in
           the `x-areal-session` header (for code that cannot change its base URL's path)
    GET    <prefix>/sessions/{sid}          the recorded calls and the Samples they make
    DELETE <prefix>/sessions/{sid}

`openai.AsyncOpenAI(base_url=".../sessions/<sid>/v1", api_key=<rollout.openai.api_key>)`
is all an agent needs. Every route first checks the bearer key and the body's size
(areal_ray/rollout/openai/auth.py: a 401 or 413 before the body is read or parsed), then
parses it strictly (payload.py: a 400 for bad UTF-8, depth, lone surrogates). Any other
path is a 404 in OpenAI's error format naming the routes there are. Every call of a session is recorded token by token (areal_ray/rollout/openai/sessions.py)
and generated through the Rollout deployment's handle (an `EngineClient`: a lost
replica is retried) with interruptible resubmission, so a weight push never reaches the
agent and every token keeps the version that sampled it
(areal_ray/rollout/openai/service.py does the work; this module maps routes onto it).

Several replicas, each session on one (`rollout.openai.replicas`): the endpoint is that
many deployments of one replica each ("shards"); the ingress, `OpenAI`, is shard 0 and
forwards a session's calls to the shard its id hashes to (`OpenAI-1`, ...), so every
call of a session reaches the replica that holds it, and a shard that restarted
refuses its lost sessions with a 410 (areal_ray/rollout/openai/affinity.py says why
not Serve's model multiplexing). Every answer names the replica that served it in the
`x-areal-endpoint-replica` header. Each shard bounds its memory:
`rollout.openai.max_sessions` live sessions of at most `max_session_bytes` each, and
`session_ttl_s`. The shards only render, tokenize and wait on the Rollout replicas,
which do the generating; more than one helps when sessions outgrow one process.

The app's ingress is then this deployment: the training pipeline keeps calling the
Rollout deployment by name (`serve.get_deployment_handle(DEPLOYMENT_NAME, app)`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

from areal_ray.rollout.engine_client import DRAIN_POLL_S, EngineClient
from areal_ray.rollout.engines.limits import RequestLimits
from areal_ray.rollout.openai.affinity import SessionLost, SessionRegistry, shard_of
from areal_ray.rollout.openai.auth import RequestGuard
from areal_ray.rollout.openai.payload import parse_body
from areal_ray.rollout.openai.protocol import SESSION_HEADER, APIError, Defaults, no_session, unknown_route
from areal_ray.rollout.openai.service import SID, OpenAIService
from areal_ray.rollout.openai.sessions import SessionStore
from areal_ray.rollout.openai.sse import EventStream

logger = logging.getLogger("ray.serve")

OPENAI_DEPLOYMENT = "OpenAI"
REPLICA_HEADER = "x-areal-endpoint-replica"
REGISTRY_NAMESPACE = "areal_openai_sessions"
api = FastAPI(title="areal-ray OpenAI-compatible rollout endpoint")


# The engine arguments that set an engine's context below the model config's
# (vLLM's and HFEngine's max_model_len, sglang's context_length).
CONTEXT_ARGS = ("max_model_len", "context_length")


@dataclass
class EndpointOptions:
    max_sessions: int  # per replica
    session_ttl_s: float
    max_tokens: int  # default and most max_tokens: rollout.max_new_tokens
    temperature: float  # default temperature: rollout.temperature
    max_model_len: int | None = None  # the engines' context, when set below the model's
    api_key: str = ""
    max_request_bytes: int = 8 << 20
    max_session_bytes: int | None = None
    tool_parser: str = "none"  # rollout.openai.tool_parser: vLLM's tool parser by name
    replicas: int = 1  # rollout.openai.replicas: session shards
    registry: str = ""  # this build's prefix in the session registry (affinity.py)

    def __repr__(self) -> str:  # Serve logs its deployments' init args: never the key
        return (f"EndpointOptions(max_sessions={self.max_sessions}, replicas={self.replicas}, "
                "api_key=<redacted>)")

    @classmethod
    def from_config(cls, rollout) -> EndpointOptions:
        """From the run's `rollout` section (`RolloutConfig`: the endpoint reads nothing
        else). Needs the key: the run makes one when rollout.openai.api_key is empty
        (agent_workflow.resolve_endpoint), so its workflow gets the same. Each call is a
        new build, with its own registry prefix."""
        o, kw = rollout.openai, rollout.engine_kwargs or {}
        if not o.api_key:
            raise ValueError("rollout.openai.api_key is empty: resolve_endpoint(cfg) makes the "
                             "run's key before the endpoint is built")
        return cls(o.max_sessions, o.session_ttl_s, rollout.max_new_tokens,
                   rollout.temperature, next((kw[k] for k in CONTEXT_ARGS if kw.get(k)), None),
                   o.api_key, o.max_request_bytes, o.max_session_bytes, o.tool_parser,
                   o.replicas, uuid.uuid4().hex)


@dataclass
class Reply:
    """One answer as it crosses from a shard to the ingress (picklable): the JSON, or
    the events of a stream, with the status and the replica that made it."""
    status: int
    body: dict | EventStream
    replica: str

    def response(self):
        headers = {REPLICA_HEADER: self.replica}
        if isinstance(self.body, EventStream):
            resp = self.body.response()
            resp.headers.update(headers)
            return resp
        return JSONResponse(self.body, status_code=self.status, headers=headers)


async def _answer(fn, *args) -> tuple[int, dict | EventStream]:
    """(status, the JSON of `fn(*args)`, awaited when a coroutine, or its EventStream),
    or OpenAI's error body with the status."""
    try:
        got = fn(*args)
        return 200, (await got if inspect.isawaitable(got) else got)
    except APIError as e:
        return e.status, e.body()
    except Exception as e:  # noqa: BLE001 - the agent gets a 500 with the reason, the replica lives on
        logger.exception("OpenAI endpoint request failed")
        return 500, APIError(500, f"{type(e).__name__}: {e}").body()


async def _body(guard: RequestGuard, request: Request) -> dict:
    """The JSON body, its size checked before it is read (declared) and while (read),
    its structure as it is parsed (payload.py: depth, UTF-8, a JSON object)."""
    guard.check_length(request.headers.get("content-length"))
    return parse_body(await guard.read(request.stream()))


class GcsKV:
    """The session registry's store: the GCS's key-value store, which outlives every
    actor (affinity.KV), in its own namespace."""

    def __init__(self):
        from ray.experimental.internal_kv import internal_kv_get_gcs_client
        self.gcs, self.ns = internal_kv_get_gcs_client(), REGISTRY_NAMESPACE.encode()

    async def get(self, key: str) -> str | None:
        got = await self.gcs.async_internal_kv_get(key.encode(), self.ns)
        return None if got is None else got.decode()

    async def put(self, key: str, value: str) -> None:
        await self.gcs.async_internal_kv_put(key.encode(), value.encode(), True, self.ns)

    async def delete(self, key: str) -> None:
        await self.gcs.async_internal_kv_del(key.encode(), False, self.ns)


# The service methods a session route calls, and whether each may open the session.
SESSION_METHODS = {"completions": True, "chat": True, "responses": True, "open_session": True,
                   "session": False, "delete": False}


class SessionShard:
    """One shard's sessions: the service, with the registry check around each call.
    The ingress holds shard 0 in-process; shards 1.. are deployments of this class
    (Serve allows one FastAPI ingress per app, so they are plain ones)."""

    def __init__(self, rollout, model_path: str, opts: EndpointOptions, index: int):
        from areal_ray.rollout.openai.tool_calls import ToolCallParser
        from areal_ray.task.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(model_path)
        incarnation = uuid.uuid4().hex
        self.name = f"{OPENAI_DEPLOYMENT}-{index}#{incarnation[:8]}"
        self.registry = SessionRegistry(GcsKV(), opts.registry, incarnation, self.name)
        self.service = OpenAIService(
            tokenizer, EngineClient(rollout), Defaults(opts.max_tokens, opts.temperature),
            SessionStore(opts.max_sessions, opts.session_ttl_s, max_session_bytes=opts.max_session_bytes,
                         on_drop=self._forget),
            model_name=Path(model_path).name,
            limits=RequestLimits.from_pretrained(model_path, opts.max_model_len),
            max_tokens_cap=opts.max_tokens,
            tool_parser=None if opts.tool_parser == "none" else ToolCallParser(opts.tool_parser, tokenizer))
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def of(cls, service: OpenAIService, registry: SessionRegistry, name: str) -> SessionShard:
        """A shard over parts made elsewhere (tests: no model, no Ray)."""
        shard = cls.__new__(cls)
        shard.service, shard.registry, shard.name, shard._tasks = service, registry, name, set()
        return shard

    def _forget(self, sid: str) -> None:
        """A session dropped after its TTL: out of the registry (in the background: the
        store drops it inside a request's call)."""
        task = asyncio.get_running_loop().create_task(self.registry.release(sid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def call(self, method: str, sid: str, body: dict | None = None) -> Reply:
        """Session `sid`'s call of the service's `method`. A session this replica does
        not hold is checked against the registry first: lost (opened by an earlier
        incarnation) is a 410, and an opening call notes it."""
        store, fn = self.service.store, getattr(self.service, method)
        args = (sid,) if body is None else (sid, body)
        checked = SID.fullmatch(sid) is not None  # a bad id is the service's 400
        try:
            if checked and sid not in store:
                await self.registry.check(sid, opening=SESSION_METHODS[method])
        except SessionLost as e:
            if method == "delete":  # the agent has been told: the id may be used again
                await self.registry.release(sid)
            return Reply(e.status, e.body(), self.name)
        status, result = await _answer(fn, *args)
        if checked and sid not in store:  # deleted, or never opened (a refused first call)
            await self.registry.release(sid)
        return Reply(status, result, self.name)


# Helpers above the class: `serve.ingress` pickles the FastAPI app by value when it
# decorates, so what its routes call must already exist then.
@serve.deployment(name=OPENAI_DEPLOYMENT)
@serve.ingress(api)
class OpenAIServer:
    """The ingress: checks the key and the body's size, then sends each session's call
    to its shard, its own (`local`, shard 0) or another's deployment handle."""

    def __init__(self, rollout, model_path: str, opts: EndpointOptions, shards: list | None = None):
        self.guard = RequestGuard(opts.api_key, opts.max_request_bytes)
        self.shards, self.n = list(shards or []), opts.replicas
        if len(self.shards) != self.n - 1:
            raise ValueError(f"the ingress needs the handles of {self.n - 1} other shards, "
                             f"got {len(self.shards)}")
        self.local = SessionShard(rollout, model_path, opts, 0)

    async def _serve(self, request: Request, method: str, sid: str, body: bool = False):
        """Session `sid`'s `method`, for a request with the key (401 without), on the
        replica that holds the session."""
        try:
            self.guard.authorize(request.headers.get("authorization"))
            data = await _body(self.guard, request) if body else None
        except APIError as e:
            return Reply(e.status, e.body(), self.local.name).response()
        k = shard_of(sid, self.n)
        if k == 0:
            return (await self.local.call(method, sid, data)).response()
        try:
            reply = await self.shards[k - 1].call.remote(method, sid, data)
        except Exception as e:  # noqa: BLE001 - the shard died mid-call (RayActorError, ...)
            logger.warning("OpenAI endpoint shard %d failed on session %r: %s", k, sid, e)
            lost = APIError(503, f"session {sid!r}: the endpoint replica holding it (shard {k}) "
                                 f"failed during this call ({type(e).__name__}); if it restarted, "
                                 "the session is lost and the next call says so (410)")
            return Reply(503, lost.body(), f"{OPENAI_DEPLOYMENT}-{k}").response()
        return reply.response()

    @api.post("/sessions/{sid}/v1/completions")
    async def completions(self, sid: str, request: Request):
        return await self._serve(request, "completions", sid, body=True)

    @api.post("/sessions/{sid}/v1/chat/completions")
    async def chat_completions(self, sid: str, request: Request):
        return await self._serve(request, "chat", sid, body=True)

    @api.post("/sessions/{sid}/v1/responses")
    async def responses(self, sid: str, request: Request):
        return await self._serve(request, "responses", sid, body=True)

    @api.get("/sessions/{sid}/v1/models")
    async def models(self, sid: str, request: Request):
        try:
            self.guard.authorize(request.headers.get("authorization"))
        except APIError as e:
            return Reply(e.status, e.body(), self.local.name).response()
        return Reply(200, self.local.service.models(), self.local.name).response()

    @api.get("/v1/models")
    async def models_of_any_session(self, request: Request):
        return await self.models("", request)

    async def _by_header(self, request: Request, method: str):
        """`<prefix>/v1/...`: the session named by the SESSION_HEADER header, or a 400
        naming both ways to name one (never a bare 404)."""
        sid = request.headers.get(SESSION_HEADER)
        if sid:
            return await self._serve(request, method, sid, body=True)
        return self._refuse(request, no_session(str(request.url)))

    @api.post("/v1/chat/completions")
    async def chat_completions_by_header(self, request: Request):
        return await self._by_header(request, "chat")

    @api.post("/v1/completions")
    async def completions_by_header(self, request: Request):
        return await self._by_header(request, "completions")

    @api.post("/v1/responses")
    async def responses_by_header(self, request: Request):
        return await self._by_header(request, "responses")

    @api.post("/sessions/{sid}")
    async def open_session(self, sid: str, request: Request):
        return await self._serve(request, "open_session", sid, body=True)

    @api.get("/sessions/{sid}")
    async def session(self, sid: str, request: Request):
        return await self._serve(request, "session", sid)

    @api.delete("/sessions/{sid}")
    async def delete(self, sid: str, request: Request):
        return await self._serve(request, "delete", sid)

    def _refuse(self, request: Request, error: APIError):
        """`error`, or the 401 when the request lacks the key (checked first)."""
        try:
            self.guard.authorize(request.headers.get("authorization"))
        except APIError as e:
            error = e
        return Reply(error.status, error.body(), self.local.name).response()

    # Last, so every route above matches first: any other path or method is a 404 in
    # OpenAI's format naming the routes there are (the Responses API's names what to
    # use instead), which the client raises with that message.
    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def unknown(self, path: str, request: Request):
        return self._refuse(request, unknown_route(request.method, str(request.url)))


def build_openai_app(cfg, rollout_app, model_path: str):
    """The endpoint over `rollout_app` (deployments.rollout.build_app):
    `rollout.openai.replicas` shards of one replica each (see the module docstring), the
    ingress holding shard 0; no CPU reserved (they wait on the Rollout replicas)."""
    opts = EndpointOptions.from_config(cfg.rollout)
    common = dict(num_replicas=1, max_ongoing_requests=cfg.rollout.openai.max_ongoing_requests,
                  ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False},
                  graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
    shard = serve.deployment(SessionShard)
    others = [shard.options(name=f"{OPENAI_DEPLOYMENT}-{k}", **common).bind(rollout_app, model_path, opts, k)
              for k in range(1, opts.replicas)]
    return OpenAIServer.options(**common).bind(rollout_app, model_path, opts, others)
