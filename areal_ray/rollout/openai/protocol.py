"""The OpenAI wire format, as the `openai` client sends and parses it: requests checked
into a `GenRequest`, results written back as `Completion` / `ChatCompletion` JSON.

Only what our engines can honour is accepted. They sample with a temperature, stop at
EOS or at token ids, and return one sample per request, so:

- a `stop` string of one token (as the model writes it after other text:
  `encode_inside`) becomes a stop id; a longer one is a stop string (stop_strings.py:
  the engine pauses at its last token); either way the output ends where the text of
  a stop first appears, however the model split it into tokens. The stop stays at the
  end of the returned text (vLLM's `include_stop_str_in_output=true`): the text the
  agent appends to its history is then exactly what the model generated, which keeps
  the session's token chain intact (sessions.py).
- `n` up to MAX_N: n samples of the prompt, each recorded as its own call and its own
  Sample of the session (sessions.py: a fork; a later request continues whichever
  choice its messages carry); streamed, each choice's chunks carry its index. `top_p`, penalties, `logit_bias`, `functions`, `response_format`
  other than text, `echo`, `suffix`, `best_of` are refused when set to anything but
  their defaults: silently ignoring them would change what the agent thinks it sampled.
- Chat takes `tools` and `tool_choice` (`auto`, `none`): the template renders the
  tools, the run's tool parser turns the output's calls into `tool_calls`, and an
  assistant message carrying them continues the recorded tokens (tool_calls.py).
- `stream: true` answers in server-sent events (sse.py); the chunks are cut from the
  finished answer, so they assemble to exactly the non-streamed one.
- Fields that do not change sampling (`user`, `metadata`, `store`, ...) are ignored;
  an unknown field is a 400 naming it, as OpenAI answers. `seed` is honoured: each
  choice, and each resubmission of it after a weight push, samples with a seed derived
  from it (rollout/seeds.py), so the same request draws the same tokens where the
  engine is batch-invariant. `parallel_tool_calls` may be true (the parser returns
  every call the model wrote) but not false: nothing makes the model write only one.
  `reasoning_effort`, `verbosity` and `modalities` other than text are refused.
- `logprobs` gives the sampled token's logprob only (`top_logprobs` lists are empty).
- `return_token_ids: true` (an extension, as in vLLM) adds `prompt_token_ids`,
  `token_ids` and the policy `versions` of the output to the choice.
- `max_tokens` / `max_completion_tokens` default to the run's `rollout.max_new_tokens`,
  `temperature` to `rollout.temperature`; the service (openai_service.py) cuts
  `max_tokens` to `rollout.max_new_tokens` and to the model's context, and checks a
  token-id prompt against the model's vocabulary.

Every problem is an `APIError` with the HTTP status and a message naming the field; the
deployment sends it as OpenAI's error body, which the client raises as
`openai.BadRequestError` (400), `NotFoundError` (404), ...
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_ray.rollout.seeds import SEED_BITS

IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
           "safety_identifier", "stream_options", "model"}
# field -> the values that mean "not used" (None is always accepted)
MUST_BE_DEFAULT = {"n": (1,), "stream": (False,), "top_p": (1, 1.0), "frequency_penalty": (0, 0.0),
                   "presence_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,),
                   "best_of": (1,), "suffix": ("",), "tools": ([],), "functions": ([],),
                   "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
                   "response_format": ({"type": "text"},), "audio": (), "prediction": (),
                   "web_search_options": (), "modalities": (["text"],), "reasoning_effort": (),
                   "verbosity": (), "parallel_tool_calls": (True,)}
# Why a field of MUST_BE_DEFAULT is refused, where the generic reason does not say it.
WHY_NOT = {"parallel_tool_calls": "the parser returns every call the model writes, and "
                                  "nothing makes the model write at most one",
           "reasoning_effort": "the model has no reasoning setting",
           "verbosity": "the model has no verbosity setting",
           "modalities": "it answers in text only"}
COMMON = {"max_tokens", "temperature", "stop", "logprobs", "return_token_ids", "stream", "n", "seed"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
MAX_STOPS = 4  # as OpenAI
MAX_N = 16  # choices per request: each is a whole generation, recorded in the session


# OpenAI's error code for a conversation longer than the model's context: agent
# frameworks and AgentWorkflow tell it from other 400s by this code.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


@dataclass(frozen=True)
class Defaults:
    max_tokens: int
    temperature: float


@dataclass
class GenRequest:
    """A checked request: what to render, and how to sample."""
    model: str
    max_tokens: int
    temperature: float
    stop_ids: list[int]  # the ids the engine stops at: one-token stops and pause ids
    logprobs: bool
    return_token_ids: bool
    prompt: str | list[int] | None = None  # completions: text, or token ids
    messages: list[dict] = field(default_factory=list)  # chat
    tools: list[dict] | None = None  # chat: the request's tools, rendered by the template
    tool_choice: str = "none"  # "auto": parse the output's calls; "none": do not
    stream: bool = False  # answer in server-sent events (sse.py)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    n: int = 1  # choices: samples of the same prompt ids
    # every stop's text: the output ends where one first appears, whatever tokens wrote
    # it (on a sub-word tokenizer a one-token stop can be written in several tokens)
    stop_strings: list[str] = field(default_factory=list)
    pause_ids: list[int] = field(default_factory=list)  # their last tokens, where the engine pauses
    seed: int | None = None  # the request's seed: each choice's calls are seeded from it


def _check_fields(body: dict, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed - IGNORED - set(MUST_BE_DEFAULT))
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    for name, ok in MUST_BE_DEFAULT.items():
        value = body.get(name)
        if name in allowed:  # this route takes it (checked where it is read)
            continue
        if value is not None and value not in ok:
            why = WHY_NOT.get(name, "it samples with a temperature and stops on token ids")
            raise bad(f"{name}={value!r} is not supported by this endpoint ({why}): "
                      f"leave {name} out", name)
    if not isinstance(body.get("model"), str):
        raise bad("model: a string is required", "model")


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        limits = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad(f"{name} must be an integer {limits}, got {v!r}", name)
    return v


def stops(stop, encode: Callable[[str], list[int]]) -> tuple[list[int], list[str], list[int]]:
    """(the stop ids of one-token stops, the longer stop strings, the ids where the
    engine pauses to look for those: their last tokens) of `stop`, a string or a list
    of strings."""
    if stop is None:
        return [], [], []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop: at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
    ids, strings, pauses = [], [], []
    for s in stops:
        toks = encode(s) if s else []
        if not toks:
            raise bad(f"stop sequence {s!r} is 0 tokens", "stop")
        inside = encode_inside(s, encode)
        if len(inside) == 1:
            # "}" written after other text; also " }", its encoding alone on a
            # SentencePiece tokenizer, whose text holds the stop too
            ids += [inside[0]] + (toks if len(toks) == 1 else [])
        else:
            strings.append(s)
            pauses += [inside[-1], toks[-1]]
    ids = list(dict.fromkeys(ids))
    return ids, strings, [t for t in dict.fromkeys(pauses) if t not in ids]


# A text that no tokenizer merges with what follows it (SentencePiece writes a newline
# as its own byte token; a byte-level BPE's newline token ends before other text).
ANCHOR = "\n"


def encode_inside(s: str, encode: Callable[[str], list[int]]) -> list[int]:
    """`s`'s ids as the model writes it after other text. A SentencePiece tokenizer
    encodes a text's start as a new word: `encode("}")` is "▁}", while `x}` ends in
    "}", so a stop matched by `encode(s)` alone never fires mid-text. Falls back to
    `encode(s)` where the anchor merges with `s`."""
    head, both = encode(ANCHOR), encode(ANCHOR + s)
    return both[len(head):] if both[:len(head)] == head and len(both) > len(head) else encode(s)


def stop_ids(stop, encode: Callable[[str], list[int]]) -> list[int]:
    """Every id the engine stops at for `stop`: one-token stops, and the pause ids of
    the longer ones."""
    ids, _, pauses = stops(stop, encode)
    return ids + pauses


def _temperature(body: dict) -> float | None:
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2):
        raise bad(f"temperature must be a number in [0, 2], got {t!r}", "temperature")
    return t


def parse_defaults(body: dict, defaults: Defaults) -> Defaults:
    """A session's own defaults (`POST /sessions/{sid}`): what its requests get when
    they leave max_tokens / temperature out, e.g. greedy for an evaluation's sessions."""
    unknown = set(body) - {"max_tokens", "temperature"}
    if unknown:
        raise bad(f"unknown session settings {sorted(unknown)}: only max_tokens, temperature")
    t = _temperature(body)
    return Defaults(_int(body, "max_tokens", 1) or defaults.max_tokens,
                    float(defaults.temperature if t is None else t))


def _sampling(body: dict, defaults: Defaults, encode, max_tokens_names: tuple[str, ...]) -> dict:
    budget = None
    for name in max_tokens_names:
        budget = budget if budget is not None else _int(body, name, 1)
    t = _temperature(body)
    rti, stream = body.get("return_token_ids"), body.get("stream")
    for name, v in (("return_token_ids", rti), ("stream", stream)):
        if v is not None and not isinstance(v, bool):
            raise bad(f"{name} must be a boolean", name)
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise bad("stream_options must be an object like {include_usage: bool}", "stream_options")
    stop = body.get("stop")
    ids, _, pauses = stops(stop, encode)
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    n = _int(body, "n", 1, MAX_N) or 1
    seed = _int(body, "seed", 0, 2 ** SEED_BITS - 1)
    return dict(model=body["model"], max_tokens=budget or defaults.max_tokens, n=n, seed=seed,
                temperature=float(defaults.temperature if t is None else t),
                stop_ids=ids + pauses, stop_strings=strings, pause_ids=pauses,
                return_token_ids=bool(rti),
                stream=bool(stream), include_usage=bool(stream and (opts or {}).get("include_usage")))


def parse_completion(body: dict, defaults: Defaults, encode) -> GenRequest:
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise bad("prompt must be one non-empty string or one list of token ids "
                  "(one prompt per request)", "prompt")
    lp = _int(body, "logprobs", 0, 5)
    return GenRequest(prompt=prompt, logprobs=lp is not None,
                      **_sampling(body, defaults, encode, ("max_tokens",)))


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                   and isinstance(p.get("text"), str) for p in c):
        return "".join(p["text"] for p in c)
    raise bad(f"messages[{i}].content: only text (a string or text parts) is supported",
              "messages")


def check_tools(tools, tool_choice) -> tuple[list[dict] | None, str]:
    """The request's `tools` and `tool_choice` checked in the shape the chat template
    and the parser take: (tools or None, "auto" | "none"); tool_calls.py does the rest."""
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise bad("tools must be a list of {type: function, function: {name, description?, "
                      "parameters?}}", "tools")
    tools = tools or None
    choice = "auto" if tool_choice is None else tool_choice
    if choice not in ("auto", "none"):
        raise bad(f"tool_choice={tool_choice!r} is not supported: only 'auto' and 'none' "
                  "('required' and a named function need constrained decoding, which this "
                  "endpoint's engines do not do)", "tool_choice")
    return tools, choice if tools else "none"


def parse_chat(body: dict, defaults: Defaults, encode) -> GenRequest:
    _check_fields(body, CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role", "messages")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
            raise bad(f"messages[{i}].tool_calls must be a list of {{id, type, function}}", "messages")
        messages.append({**m, "content": _content(m, i)})
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    _int(body, "top_logprobs", 0, 20)
    tools, tool_choice = check_tools(body.get("tools"), body.get("tool_choice"))
    return GenRequest(messages=messages, logprobs=bool(lp), tools=tools, tool_choice=tool_choice,
                      **_sampling(body, defaults, encode, ("max_completion_tokens", "max_tokens")))


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of `messages` (and `tools`, which the template writes where the
    model expects them) by the tokenizer's chat template, with the assistant's
    generation prompt; a 400 when the tokenizer has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad(f"the model's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no "
                  "chat template: use /v1/completions with a prompt string", "messages")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template raising on these messages is the request's fault
        raise bad(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                  "messages") from e


def _extension(req: GenRequest, prompt_ids, sample) -> dict:
    if not req.return_token_ids:
        return {}
    return {"prompt_token_ids": list(prompt_ids), "token_ids": list(sample.output_ids),
            "versions": list(sample.versions)}


@dataclass
class Choice:
    """One generated choice as the responses write it."""
    sample: object  # types.Sample: output ids, logprobs, versions, stop reason
    text: str  # the output as the client sees it
    token_texts: list[str]  # each output token's text (only with logprobs)
    parsed: object = None  # tool_calls.Parsed: the calls found in `text` (chat with tools)


def _usage_of(prompt_ids: list[int], choices: list[Choice]) -> dict:
    """As OpenAI counts n choices: the prompt once, every choice's tokens."""
    out = sum(len(c.sample.output_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": out,
            "total_tokens": len(prompt_ids) + out}


def completion_response(req: GenRequest, prompt_ids: list[int], choices: list[Choice]) -> dict:
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if req.logprobs:
            offsets, at = [], 0
            for t in c.token_texts:
                offsets.append(at)
                at += len(t)
            logprobs = {"tokens": c.token_texts, "token_logprobs": list(c.sample.logprobs),
                        "text_offset": offsets, "top_logprobs": None}
        out.append({"index": i, "text": c.text, "finish_reason": c.sample.stop_reason,
                    "logprobs": logprobs, **_extension(req, prompt_ids, c.sample)})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": req.model, "choices": out,
            "usage": _usage_of(prompt_ids, choices)}


def chat_response(req: GenRequest, prompt_ids: list[int], choices: list[Choice]) -> dict:
    """A choice's `parsed` calls make its message's content the text outside them, and
    its finish reason `tool_calls`, as OpenAI's."""
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if req.logprobs:
            logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                     "top_logprobs": []}
                                    for t, lp in zip(c.token_texts, c.sample.logprobs)], "refusal": None}
        message, finish = {"role": "assistant", "content": c.text}, c.sample.stop_reason
        if c.parsed is not None and c.parsed.tool_calls:
            message = {"role": "assistant", "content": c.parsed.content, "tool_calls": c.parsed.tool_calls}
            finish = "tool_calls"
        out.append({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs,
                    **_extension(req, prompt_ids, c.sample)})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": req.model, "choices": out,
            "usage": _usage_of(prompt_ids, choices)}


def models_response(name: str, created: int) -> dict:
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "areal-ray"}]}


# The header that names the session when the base URL does not (`<prefix>/v1`).
SESSION_HEADER = "x-areal-session"
SESSION_ROUTES = ("POST chat/completions", "POST completions", "POST responses", "GET models")


def session_url(url: str) -> str:
    """The session form of the base URL a request was sent to: everything before its
    `/v1` (or before the route, when it has none), then `/sessions/<sid>/v1`."""
    head = url.split("?")[0]
    cut = head.rfind("/v1")
    head = head[:cut] if cut >= 0 else head.rsplit("/", 1)[0]
    if "/sessions/" in head:
        head = head[:head.rfind("/sessions/")]
    return f"{head.rstrip('/')}/sessions/<sid>/v1"


def no_session(url: str) -> APIError:
    """A call on `<prefix>/v1` that names no session: every call belongs to one (its
    tokens are recorded for training), so the answer says how to name it."""
    return APIError(400, f"no session: this endpoint records each agent's calls as a session, "
                         f"named in the base URL (base_url='{session_url(url)}', <sid> a name of "
                         f"letters, digits or '-_.:') or in the '{SESSION_HEADER}' header "
                         f"(default_headers={{'{SESSION_HEADER}': <sid>}} on the openai client)",
                    None, "session_required")


def unknown_route(method: str, url: str) -> APIError:
    """A 404 in OpenAI's format for a route the endpoint does not have, naming the
    routes it has (for the Responses API's stored responses, what to do instead)."""
    path = url.split("?")[0]
    if "/v1/responses/" in path:
        return APIError(404, "the endpoint stores no responses: it serves POST /v1/responses only "
                             "(send the whole input each time, the Agents SDK's default; or "
                             "Chat Completions: OpenAIChatCompletionsModel in the Agents SDK, "
                             "ChatOpenAI(use_responses_api=False) in LangChain)",
                        None, "responses_not_stored")
    return APIError(404, f"no route {method} {path}: this endpoint serves "
                         f"{', '.join(SESSION_ROUTES)} under {session_url(url)} "
                         "(and GET, DELETE of the session itself)", None, "unknown_url")
