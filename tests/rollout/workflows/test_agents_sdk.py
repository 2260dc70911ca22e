"""The OpenAI Agents SDK (`openai-agents`, not a dependency: skipped unless installed)
running a tool-calling agent against the endpoint's service, in this process through
an ASGI transport, with a scripted engine whose first output is a hermes call: the SDK
reads `tool_calls`, runs the function tool, sends the result back as a `role: tool`
message, and the session records one trajectory; the same with `Runner.run_streamed`
(the SDK streams chat completions and assembles the tool call from the chunks)."""

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

agents = pytest.importorskip("agents")


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_agent_calls_a_tool_through_the_endpoint(tokenizer, hermes, streamed):  # noqa: F811
    from openai import AsyncOpenAI
    svc = scripted_service(tokenizer, hermes, ["ok " + CALL_TEXT, "\\boxed{15}"])
    ran, bodies = [], []

    @agents.function_tool
    def calc(expr: str) -> str:
        """Evaluate an arithmetic expression."""
        ran.append(expr)
        return "=15"

    client = AsyncOpenAI(base_url="http://endpoint/sessions/s/v1", api_key="none",
                         http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(svc, bodies))))
    agent = agents.Agent(name="calc", instructions="Add.", tools=[calc],
                         model=agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client))
    agents.set_tracing_disabled(True)

    async def go():
        if not streamed:
            return (await agents.Runner.run(agent, "12+3=")).final_output
        run = agents.Runner.run_streamed(agent, "12+3=")
        async for _ in run.stream_events():
            pass
        return run.final_output

    assert asyncio.run(go()) == "\\boxed{15}" and ran == ["12+3"]
    assert [bool(b.get("stream")) for b in bodies] == [streamed] * 2 and bodies[0]["tools"]
    assert bodies[1]["messages"][-1]["role"] == "tool"
    session = svc.session("s")
    c0, c1 = session["calls"]
    assert c1["extends"] == 0 and len(session["samples"]) == 1
