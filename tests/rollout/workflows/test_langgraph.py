"""examples/langgraph_agent.py (LangGraph and langchain-openai, pinned in requirements.txt) against the endpoint's service, in this process through an ASGI
transport, with a scripted engine whose first output is a hermes call (the embedded char
model cannot spell JSON): ChatOpenAI sends the bound tool, reads `tool_calls`, LangGraph's
ToolNode runs the calculator and sends the result back as a `role: tool` message, and
the session records one trajectory whose calls continue each other's ids."""

import asyncio

import httpx
import pytest

from tests.rollout.openai.test_tool_calls import (  # noqa: F401 - fixtures
    CALL_TEXT,
    asgi_app,
    hermes,
    scripted_service,
    tokenizer,
)


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_a_langgraph_agent_calls_the_calculator_through_the_endpoint(tokenizer, hermes, responses):  # noqa: F811
    """Chat Completions (LangChain's default), and the Responses API
    (`ChatOpenAI(use_responses_api=True)`), unchanged: both are one session."""
    from openai import AsyncOpenAI

    from examples.langgraph_agent import langgraph_agent
    svc = scripted_service(tokenizer, hermes, ["ok " + CALL_TEXT, "\\boxed{15}"])
    bodies = []
    client = AsyncOpenAI(base_url="http://endpoint/sessions/s/v1", api_key="none", max_retries=0,
                         http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(svc, bodies))))

    answer = asyncio.run(langgraph_agent(client, {"prompt": "12+3="}, use_responses_api=responses))
    assert answer == "\\boxed{15}"
    if responses:
        assert [t["name"] for t in bodies[0]["tools"]] == ["calc"]  # bind_tools, as Responses tools
        assert "expr" in bodies[0]["tools"][0]["parameters"]["properties"]
        call, output = bodies[1]["input"][-2:]
        assert call["type"] == "function_call" and output["type"] == "function_call_output"
        assert output["output"] == "15" and output["call_id"] == call["call_id"]  # the calculator ran
    else:
        assert [t["function"]["name"] for t in bodies[0]["tools"]] == ["calc"]  # bind_tools, rendered
        assert "expr" in bodies[0]["tools"][0]["function"]["parameters"]["properties"]
        tool_msg = bodies[1]["messages"][-1]
        assert tool_msg["role"] == "tool" and tool_msg["content"] == "15"  # the calculator ran
        assert bodies[1]["messages"][-2]["tool_calls"][0]["id"] == tool_msg["tool_call_id"]
    session = svc.session("s")
    c0, c1 = session["calls"]
    assert c1["extends"] == 0 and len(session["samples"]) == 1
    history = c0["prompt_ids"] + c0["output_ids"]
    assert c1["prompt_ids"][:len(history)] == history  # no token re-encoded
