"""The Responses API as a view of Chat Completions (responses.py): request mapping and
refusals table-driven; answers the `openai` package's types accept; and the OpenAI
Agents SDK with its default model (`OpenAIResponsesModel`, the Responses API) running a
tool conversation against the endpoint's service unchanged, plain and streamed, with a
scripted engine whose first output is a hermes call: one recorded Sample."""

import asyncio

import httpx
import pytest
from openai.types.responses import Response

from areal_ray.rollout.openai.protocol import APIError
from areal_ray.rollout.openai.responses import chat_request, response_events, response_of
from tests.rollout.openai.test_tool_calls import (  # noqa: F401 - fixtures
    CALL_TEXT,
    asgi_app,
    hermes,
    scripted_service,
    tokenizer,
)

TOOL = {"type": "function", "name": "calc", "description": "d", "strict": True,
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}


@pytest.mark.parametrize("body,chat", [
    ({"model": "m", "input": "hi"}, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 5, "temperature": 0,
      "include": [], "store": False, "stream": True},
     {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
      "max_completion_tokens": 5, "temperature": 0, "store": False, "stream": True}),
    ({"model": "m", "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": True, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "12+3="}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok ", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "calc", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "15"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "1"}]},
        {"role": "developer", "content": "go on"}]},
     {"model": "m", "tools": [CHAT_TOOL], "tool_choice": "auto", "parallel_tool_calls": True, "messages": [
         {"role": "user", "content": "12+3="},
         {"role": "assistant", "content": "ok ", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "15"},
         {"role": "tool", "tool_call_id": "c2", "content": "1"},
         {"role": "system", "content": "go on"}]}),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     {"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
])
def test_a_responses_request_is_the_chat_request_it_maps_to(body, chat):
    assert chat_request(body) == chat


@pytest.mark.parametrize("extra,needle,param", [
    ({"previous_response_id": "resp_1"}, "stores no responses", "previous_response_id"),
    ({"conversation": "c"}, "stores no conversations", "conversation"),
    ({"reasoning": {"effort": "low"}}, "reasoning=", "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include=", "include"),
    ({"text": {"format": {"type": "json_schema"}}}, "plain text", "text"),
    ({"truncation": "auto"}, "never cut", "truncation"),
    ({"bogus": 1}, "unrecognized request argument(s): bogus", "bogus"),
    ({"input": []}, "non-empty list", "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "type 'reasoning' are not supported", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text content", "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be", "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "needs its call_id", "input"),
    ({"tools": [{"type": "web_search"}]}, "only function tools", "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "calc"}}, "a named tool", "tool_choice"),
    ({"tool_choice": "required"}, "needs tools", "tool_choice"),
])
def test_what_the_endpoint_cannot_honour_is_refused_by_name(extra, needle, param):
    with pytest.raises(APIError) as e:
        chat_request({"model": "m", "input": "hi", **extra})
    assert e.value.status == 400 and needle in e.value.message and e.value.param == param


def chat_answer(content, calls=(), finish="stop"):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c, "type": "function", "function": {"name": "calc", "arguments": "{}"}}
                                 for c in calls]
    return {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


@pytest.mark.parametrize("chat,asked,kinds,status", [
    (chat_answer("15"), None, ["message"], "completed"),
    (chat_answer("", ["c1", "c2"], "tool_calls"), None, ["function_call", "function_call"], "completed"),
    (chat_answer("ok ", ["c1"], "tool_calls"), None, ["message", "function_call"], "completed"),
    (chat_answer("1234", finish="length"), 2, ["message"], "incomplete"),  # its own budget
    (chat_answer("1234", finish="length"), None, ["message"], "completed"),  # the run's cap
    (chat_answer("1234", finish="length"), 50, ["message"], "completed"),
])
def test_a_chat_answer_is_a_response_the_client_parses(chat, asked, kinds, status):
    body = {"model": "m", "input": "x", "tools": [TOOL], "max_output_tokens": asked}
    resp = Response.model_validate(response_of(chat, body))
    assert [o.type for o in resp.output] == kinds and resp.status == status
    assert resp.output_text == (chat["choices"][0]["message"]["content"] or "")
    assert [o.call_id for o in resp.output if o.type == "function_call"] == \
        [c["id"] for c in chat["choices"][0]["message"].get("tool_calls", [])]
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (3, 2)
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in response_events(resp.model_dump())]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == f"response.{status}"
    assert [o.id for o in events[-1].response.output] == [o.id for o in resp.output]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text


agents = pytest.importorskip("agents")


@pytest.mark.parametrize("streamed", [False, True])
def test_the_agents_sdks_default_model_runs_a_tool_conversation_unchanged(tokenizer, hermes, streamed):  # noqa: F811
    """`OpenAIResponsesModel` (what `Agent(model="...")` uses by default) over the
    endpoint: the call comes back as a function_call item, the SDK runs the tool and
    sends the whole input back with its output, and the session records both calls as
    one chain, as the same agent on Chat Completions does."""
    from openai import AsyncOpenAI
    svc = scripted_service(tokenizer, hermes, ["ok " + CALL_TEXT, "\\boxed{15}"])
    bodies = []
    client = AsyncOpenAI(base_url="http://endpoint/sessions/s/v1", api_key="none", max_retries=0,
                         http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(svc, bodies))))

    @agents.function_tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        return str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - the test's own "12+3"

    agent = agents.Agent(name="calculator", tools=[calc],
                         model=agents.OpenAIResponsesModel(model="policy", openai_client=client))
    config = agents.RunConfig(tracing_disabled=True)

    async def go():
        if not streamed:
            return (await agents.Runner.run(agent, "12+3=", run_config=config)).final_output
        run = agents.Runner.run_streamed(agent, "12+3=", run_config=config)
        async for _ in run.stream_events():
            pass
        return run.final_output

    assert asyncio.run(go()) == "\\boxed{15}"
    assert [bool(b.get("stream")) for b in bodies] == [streamed] * 2
    assert [t["name"] for t in bodies[0]["tools"]] == ["calc"]
    assert [i.get("type") for i in bodies[1]["input"]][-2:] == ["function_call", "function_call_output"]
    assert bodies[1]["input"][-1]["output"] == "15"  # the calculator ran on "12+3"
    session = svc.session("s")
    c0, c1 = session["calls"]
    assert c1["extends"] == 0 and len(session["samples"]) == 1


def test_an_answer_cut_by_the_runs_budget_does_not_fail_the_agents_sdk_run(random_model_dir):
    """On a real engine whose answers end at the run's max_new_tokens (finish "length"):
    the SDK's default model fails a run on an incomplete response, so a cut the agent
    did not ask for is a completed one, and the run returns the text."""
    import torch
    from openai import AsyncOpenAI

    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.engines.hf import HFEngine
    from areal_ray.rollout.openai.protocol import Defaults
    from areal_ray.rollout.openai.service import OpenAIService
    from areal_ray.rollout.openai.sessions import SessionStore
    from tests.rollout.workflows.test_base import InProcessApp
    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    svc = OpenAIService(engine.tokenizer, EngineClient(InProcessApp(engine)), Defaults(3, 1.0),
                        SessionStore(4, 600), model_name="tiny", max_tokens_cap=3)
    client = AsyncOpenAI(base_url="http://endpoint/sessions/s/v1", api_key="none", max_retries=0,
                         http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(svc, []))))
    agent = agents.Agent(name="a", model=agents.OpenAIResponsesModel(model="policy", openai_client=client))
    result = asyncio.run(agents.Runner.run(agent, "12+3=", run_config=agents.RunConfig(tracing_disabled=True)))
    (call,) = svc.session("s")["calls"]
    assert call["finish_reason"] == "length" and len(call["output_ids"]) == 3
    assert result.final_output == engine.tokenizer.decode(call["output_ids"], skip_special_tokens=True)
