"""What the OpenAI-compatible endpoint does per request, without Serve or FastAPI:
check the request (openai_protocol.py), work out the prompt ids from the session's
recorded calls (sessions.py: token ids are reused, never re-encoded), generate through
the engine client with interruptible resubmission, record the call, answer in the
OpenAI format.

Generation goes through `generate_rounds` (interruptible.py): a weight push that
aborts the request is resubmitted with prompt + partial output, so the agent never
sees an abort; each token keeps the version of the policy that sampled it, and the
recorded call holds them all. The `EngineClient` retries a call that lost its replica.

Bad requests are 400s, never 500s and never a rollout replica's problem: a token-id
prompt is checked against the model's vocabulary, and every prompt against its
context, here with the same `RequestLimits` the replicas use (limits.py), before
anything is generated; `max_tokens` is cut to the run's `rollout.max_new_tokens` and
to the room the context leaves (a call asking for more ends "length" there, as its
`finish_reason` says, so agent code written with a large `max_tokens` runs unchanged).
A request the replica refuses all the same (its engine's context may be shorter than
the model config's) is a 400 with its message. A text prompt that cannot fit the
context is refused by its UTF-8 bytes before it is tokenized (payload.check_fits), and
prompts are rendered and tokenized in threads (TOKENIZE_THREADS): a long one never
holds up the event loop every other session's calls run on.

The session store's bounds (sessions.py) answer here: a new session when the store is
full of live ones is a 429, a call past the session's byte budget a 400; either way
no other session is touched. Session ids are checked to be short URL-safe names.

`n > 1` generates the n choices of one prompt at once and records each as its own
call and Sample (sessions.py: a fork).

Chat requests with `tools` go through tool_calls.py (rendering, the run's vLLM tool
parser, assistant tool calls replayed as the recorded text); `stream: true` answers
are cut into chunks from the finished answer (sse.py). The Responses API is the chat
call it maps to (responses.py). A `seed` seeds each choice's engine calls.

The deployment (deployments/openai_api.py) maps routes onto these methods; tests drive
them with an in-process engine.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from areal_ray.rollout.engines.limits import ContextFull, RequestLimits, RequestRejected
from areal_ray.rollout.interruptible import PartialSample, generate_rounds
from areal_ray.rollout.openai.auth import EndpointError
from areal_ray.rollout.openai.payload import check_fits, max_token_bytes
from areal_ray.rollout.openai.protocol import (
    CONTEXT_LENGTH_EXCEEDED,
    APIError,
    Choice,
    Defaults,
    bad,
    chat_response,
    completion_response,
    models_response,
    parse_chat,
    parse_completion,
    parse_defaults,
    render_chat,
)
from areal_ray.rollout.openai.responses import chat_request, response_events, response_of
from areal_ray.rollout.openai.sessions import SessionsFull, SessionStore, SessionTooLarge
from areal_ray.rollout.openai.sse import EventStream, chat_chunks, completion_chunks, token_texts
from areal_ray.rollout.openai.stop_strings import run_to_stop_strings
from areal_ray.rollout.openai.tool_calls import output_digest, replay_messages
from areal_ray.rollout.seeds import request_seed

if TYPE_CHECKING:
    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.openai.tool_calls import ToolCallParser

MAX_SID_CHARS = 200
# Letters, digits and `-_.:` (a uuid, a name with a counter): nothing that needs
# escaping in a URL or a log line.
SID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_SID_CHARS}}}")
# Threads that render and tokenize prompts, off the event loop every session's calls
# share: a long prompt then delays only its own call (a few at once, so one long
# prompt does not queue the others' behind it).
TOKENIZE_THREADS = 4


class OpenAIService:
    def __init__(self, tokenizer, client: EngineClient, defaults: Defaults, store: SessionStore,
                 model_name: str, limits: RequestLimits | None = None,
                 max_tokens_cap: int | None = None, tool_parser: ToolCallParser | None = None):
        """`limits`: the model's vocabulary and context (None: left to the replicas);
        `max_tokens_cap`: the most tokens one call generates (rollout.max_new_tokens);
        `tool_parser`: parses `tool_calls` from outputs (None: tool calling off)."""
        self.tokenizer, self.client, self.defaults = tokenizer, client, defaults
        self.store, self.model_name = store, model_name
        self.limits = limits or RequestLimits(None, None)
        self.max_tokens_cap = max_tokens_cap
        self.tool_parser = tool_parser
        self.created = int(time.time())
        self.token_bytes = max_token_bytes(tokenizer)  # payload.check_fits's bound
        # its threads start on first use
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="openai-tokenize")

    async def _off_loop(self, fn, *args):
        """`fn(*args)` in a tokenizing thread, awaited (see TOKENIZE_THREADS)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_rest(self, text: str) -> list[int]:
        """`text` as the whole conversation's encoding has it where it follows recorded
        ids (a tool result after the model's end of turn): a SentencePiece tokenizer
        (Metaspace, `prepend_scheme: first`) starts a string it encodes alone with a
        word-start `▁`, which it never writes after a special token, so ChatML's
        `<|im_end|>\\n<|im_start|>` would train as `<|im_end|>▁\\n<|im_start|>`. Encoded
        behind the end-of-sequence token, which is then cut off."""
        eos = getattr(self.tokenizer, "eos_token", None)
        if not eos:
            return self.encode(text)
        anchor, ids = self.encode(eos), self.encode(eos + text)
        return ids[len(anchor):] if ids[:len(anchor)] == anchor else self.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _session(self, sid: str):
        if not SID.fullmatch(sid):
            raise APIError(400, f"session id must be 1 to {MAX_SID_CHARS} letters, digits or "
                                "'-_.:'")
        try:
            return self.store.open(sid, self.encode, self.decode, self.encode_rest)
        except SessionsFull as e:
            raise EndpointError(429, str(e)) from e

    async def _generate(self, sid: str, req, text: str | None, token_prompt: list[int] | None):
        """(prompt ids, a Choice per generated sample, the index of the first one's call)."""
        session = self._session(sid)
        try:
            if token_prompt is not None:
                prompt_ids, extends = session.prompt_ids_of_tokens(
                    self.limits.token_ids(token_prompt, "prompt token"))
                text = self.decode(prompt_ids, False)  # only ids in the vocabulary decode
            else:  # refused by its bytes before any of it is tokenized, then off the loop
                check_fits(text, self.limits.max_context, self.token_bytes,
                           "messages" if req.messages else "prompt")
                prompt_ids, extends = await self._off_loop(session.prompt_ids, text)
            self.store.check_room(session, text, len(prompt_ids), req.n)  # before any is generated
            budget = self.limits.fit(len(prompt_ids), min(req.max_tokens, self.max_tokens_cap or req.max_tokens))
            parts = [PartialSample(prompt_ids, budget, None if req.seed is None else
                                   functools.partial(request_seed, req.seed, 0, i))
                     for i in range(req.n)]
            if req.stop_strings:  # each its own pauses
                await asyncio.gather(*[run_to_stop_strings(
                    lambda p=p: generate_rounds(self.client.generate_batch, [p], req.temperature, req.stop_ids),
                    p, req.stop_strings, set(req.pause_ids), self.decode) for p in parts])
            else:  # one engine call for the n
                await generate_rounds(self.client.generate_batch, parts, req.temperature, req.stop_ids)
        except RequestRejected as e:  # ours, or a replica's (through Serve: an instance wrapping it)
            code = CONTEXT_LENGTH_EXCEEDED if isinstance(e, ContextFull) else None
            raise APIError(400, str(getattr(e, "cause", e)), "prompt", code) from e
        except SessionTooLarge as e:
            raise bad(str(e), "messages") from e
        samples = [p.sample() for p in parts]
        # The session may have been dropped (TTL) while generating: record where it is
        # now (a store that filled up meanwhile keeps only the answer).
        try:
            session = self.store.open(sid, self.encode, self.decode, self.encode_rest)
        except SessionsFull:
            pass
        session.record_turn(text, prompt_ids, extends, samples)
        choices = [Choice(s, self.decode(s.output_ids),
                          [self.decode([t], False) for t in s.output_ids] if req.logprobs else [])
                   for s in samples]
        return prompt_ids, choices, len(session.calls) - len(samples)

    def _defaults(self, sid: str) -> Defaults:
        session = self.store.get(sid)
        return session.defaults if session is not None and session.defaults else self.defaults

    def open_session(self, sid: str, body: dict) -> dict:
        """Open `sid` with its own sampling defaults (`max_tokens`, `temperature`): a
        workflow sets them for agent code that leaves them out (an evaluation's
        sessions decode greedily while training ones sample)."""
        defaults = parse_defaults(body, self.defaults)
        self._session(sid).defaults = defaults
        return {"id": sid, "max_tokens": defaults.max_tokens, "temperature": defaults.temperature}

    async def completions(self, sid: str, body: dict) -> dict:
        req = parse_completion(body, self._defaults(sid), self.encode)
        if isinstance(req.prompt, str):
            prompt_ids, choices, _ = await self._generate(sid, req, req.prompt, None)
        else:
            prompt_ids, choices, _ = await self._generate(sid, req, None, req.prompt)
        resp = completion_response(req, prompt_ids, choices)
        return EventStream(completion_chunks(resp, self._pieces(choices), req.include_usage)) \
            if req.stream else resp

    def _pieces(self, choices: list[Choice]) -> list[list[str]]:
        """Each choice's output tokens' texts, which its streamed chunks are cut at."""
        return [token_texts(c.sample.output_ids, self.decode) for c in choices]

    def _generated_text(self, sid: str):
        """The text the client was shown for call `index` of `sid`, if its output ids
        have `digest` (None: no such call)."""
        session = self.store.get(sid)
        calls = session.calls if session is not None else []

        def text(index: int, digest: str) -> str | None:
            if 0 <= index < len(calls) and output_digest(calls[index].output_ids) == digest:
                return self.decode(calls[index].output_ids)
            return None
        return text

    async def chat(self, sid: str, body: dict) -> dict | EventStream:
        req = parse_chat(body, self._defaults(sid), self.encode)
        parse = req.tools is not None and req.tool_choice == "auto"
        if parse and self.tool_parser is None:
            raise bad("tool calling is off on this endpoint (rollout.openai.tool_parser=none): "
                      "send tool_choice='none' to only render the tools", "tool_choice")
        parser_request = self.tool_parser.request(req.tools, req.tool_choice) if parse else None
        messages = replay_messages(req.messages, self._generated_text(sid))
        text = await self._off_loop(render_chat, self.tokenizer, messages, req.tools)
        prompt_ids, choices, first = await self._generate(sid, req, text, None)
        if parse:  # each choice's call ids name its own recorded call
            for i, c in enumerate(choices):
                c.parsed = self.tool_parser.parse(c.text, parser_request, first + i, c.sample.output_ids)
        resp = chat_response(req, prompt_ids, choices)
        return EventStream(chat_chunks(resp, self._pieces(choices), req.include_usage)) \
            if req.stream else resp

    async def responses(self, sid: str, body: dict) -> dict | EventStream:
        """The Responses API (responses.py): the request as the chat call it maps to,
        recorded as that call, answered as a `Response` (or its events)."""
        chat = chat_request(body)
        stream = chat.pop("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream must be a boolean", "stream")
        resp = response_of(await self.chat(sid, chat), body)
        return EventStream(response_events(resp)) if stream else resp

    def models(self) -> dict:
        return models_response(self.model_name, self.created)

    def session(self, sid: str) -> dict:
        """The recorded session: its calls and the training Samples they make."""
        session = self.store.get(sid)
        if session is None:
            raise APIError(404, f"no session {sid!r} (never used, deleted, or dropped after "
                                f"{self.store.ttl_s:.0f} s idle)")
        return session.to_dict()

    def delete(self, sid: str) -> dict:
        if self.store.pop(sid) is None:
            raise APIError(404, f"no session {sid!r}")
        return {"id": sid, "deleted": True}
