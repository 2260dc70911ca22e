"""The Responses API (`POST /v1/responses`) as a view of Chat Completions: a request's
input items become chat messages, its function tools chat tools, and the chat answer
a `Response`, so the session records it exactly as the same chat call (sessions.py),
tokens and all. This is what the OpenAI Agents SDK's default model
(`OpenAIResponsesModel`) and LangChain's `ChatOpenAI(use_responses_api=True)` send.

Input items, as the `openai` client and the Agents SDK write them:

- a string: one user message;
- `{role, content}` (type `message` or none): content a string or `input_text` /
  `output_text` parts; `developer` is a system message;
- `{type: function_call, call_id, name, arguments}`: a call of the assistant message
  before it (or of a new one): the chat `tool_calls` entry with id `call_id`, so a call
  the endpoint issued replays the recorded tokens (tool_calls.py);
- `{type: function_call_output, call_id, output}`: a `role: tool` message.

Everything else is refused by name: input items of other types (reasoning, images,
files, built-in tools' calls), tools other than functions, `previous_response_id` and
`conversation` (the endpoint stores no responses: send the whole input, as the Agents
SDK does by default), and settings the engines cannot honour. `stream: true` answers
in the Responses API's events, cut from the finished answer as chat streams are
(sse.py): `response.created`, each output item added and done (text as one delta, a
call's arguments as one), `response.completed`.

Pure: no Serve; the service generates (OpenAIService.responses).
"""

from __future__ import annotations

import time
import uuid

from areal_ray.rollout.openai.protocol import bad

# Request fields passed on to the chat request as they are (checked there).
PASSED = {"model", "temperature", "top_p", "parallel_tool_calls", "user", "metadata", "store",
          "service_tier", "prompt_cache_key", "safety_identifier"}
# Fields whose default (or empty) value is accepted and anything else refused, with why.
DEFAULTS_ONLY = {
    "include": ([], "the endpoint adds nothing to the output"),
    "truncation": ("disabled", "a prompt past the context is a 400, never cut"),
    "text": ({"format": {"type": "text"}}, "it answers in plain text"),
    "previous_response_id": (None, "the endpoint stores no responses: send the whole input "
                                   "each time (the Agents SDK's default)"),
    "conversation": (None, "the endpoint stores no conversations: send the whole input"),
    "reasoning": (None, "the model has no reasoning setting"),
    "background": (False, "it answers in the request"),
    "prompt": (None, "the endpoint has no stored prompts"),
    "top_logprobs": (None, "use Chat Completions' logprobs"),
    "max_tool_calls": (None, "the parser returns every call the model writes"),
    "context_management": (None, "a prompt past the context is a 400, never cut"),
    "prompt_cache_retention": (None, "the endpoint keeps no prompt cache"),
}
OWN = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "stream"}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"{where}: only text content (a string or input_text / output_text parts) is "
              "supported", "input")


def input_messages(items, instructions=None) -> list[dict]:
    """The chat messages of a request's `input` (and `instructions`, a system message)."""
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                          "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad(f"{where}: a function_call needs call_id, name and arguments (strings)",
                          "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}: a function_call_output needs its call_id", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), where)})
        else:
            raise bad(f"{where}: input items of type {kind!r} are not supported (only messages, "
                      "function_call and function_call_output)", "input")
    return messages


def chat_tools(tools) -> list[dict] | None:
    """The Responses API's function tools (`{type, name, description?, parameters?,
    strict?}`) as chat tools."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad(f"tools[{i}]: only function tools ({{type: function, name, parameters}}) are "
                      f"supported, got {kind!r}", "tools")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    return out


def chat_request(body: dict) -> dict:
    """The chat request a Responses API request is (see the module docstring)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - PASSED - OWN - set(DEFAULTS_ONLY))
    if unknown:
        raise bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    for name, (ok, why) in DEFAULTS_ONLY.items():
        v = body.get(name)
        if v is not None and v != ok and not (name == "include" and v == []):
            raise bad(f"{name}={v!r} is not supported by this endpoint ({why}): leave {name} out",
                      name)
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        raise bad(f"tool_choice={choice!r} is not supported: only 'auto' and 'none' (a named "
                  "tool needs constrained decoding)", "tool_choice")
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = input_messages(body.get("input"), body.get("instructions"))
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
    elif choice not in (None, "auto", "none"):
        raise bad(f"tool_choice={choice!r} needs tools", "tool_choice")
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    return chat


def response_of(chat: dict, body: dict) -> dict:
    """The `Response` of a chat answer (one choice) to `body`."""
    (choice,) = chat["choices"]
    message, finish = choice["message"], choice["finish_reason"]
    output = []
    if message.get("content") or not message.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                       "status": "completed",
                       "content": [{"type": "output_text", "text": message.get("content") or "",
                                    "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = chat["usage"]
    # Incomplete only when the request's own max_output_tokens ended it, as OpenAI's; a
    # cut by the run's rollout.max_new_tokens or the context is the endpoint's budget
    # (chat says "length"), and agent frameworks fail a run on an incomplete response.
    asked = body.get("max_output_tokens")
    length = finish == "length" and asked is not None and usage["completion_tokens"] >= asked
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(),
            "model": chat["model"], "status": "incomplete" if length else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "error": None, "instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "output": output, "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": None,
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"],
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}},
            # our extension, as chat's return_token_ids: what the session recorded
            **({"token_ids": choice["token_ids"]} if "token_ids" in choice else {})}


def response_events(resp: dict) -> list[dict]:
    """`resp` as the Responses API streams it: created, each output item added, its text
    or arguments, done, then completed (one event per part: the answer is whole)."""
    events = [{"type": "response.created",
               "response": {**resp, "status": "in_progress", "output": [], "usage": None}}]
    for i, item in enumerate(resp["output"]):
        events.append({"type": "response.output_item.added", "output_index": i,
                       "item": {**item, "status": "in_progress",
                                **({"content": []} if item["type"] == "message" else {"arguments": ""})}})
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": i,
                 "content_index": 0, "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", "item_id": item["id"], "output_index": i,
                 "content_index": 0, "delta": part["text"], "logprobs": []},
                {"type": "response.output_text.done", "item_id": item["id"], "output_index": i,
                 "content_index": 0, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": i,
                 "content_index": 0, "part": part}]
        else:
            events += [
                {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                 "output_index": i, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"],
                 "output_index": i, "name": item["name"], "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": "response.completed" if resp["status"] == "completed" else "response.incomplete",
                   "response": resp})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]

