"""The OpenAI Agents SDK (`openai-agents`) running examples/agents_sdk_agent.py against the
endpoint's service, in this process through an ASGI transport, with a scripted engine
whose first output is a hermes call: the SDK reads `tool_calls`, runs the function
tool, sends the result back as a `role: tool` message, and the session records one
trajectory; the same with `Runner.run_streamed` (the SDK streams chat completions and
assembles the tool call from the chunks). On the `hermes` char tokenizer and its chat
template (artifacts/tiny-agents'), the recorded trajectory is token for token the warm
start's training example (tool_arith.HermesCalls): what the model learned to write is
what the agent's episodes train. (On a real Serve app: tests/jobs/test_eval.py, through
conf/agents_sdk.yaml.)"""

import asyncio

import httpx
import pytest

from areal_ray.rollout.openai.tool_calls import ToolCallParser
from areal_ray.task import tool_arith
from areal_ray.task.tokenizer import build_char_tokenizer
from tests.rollout.openai.test_tool_calls import (  # noqa: F401 - fixtures
    CALL_TEXT,
    asgi_app,
    hermes,
    scripted_service,
    tokenizer,
)

agents = pytest.importorskip("agents")


def sdk_client(svc, bodies, sid="s"):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=f"http://endpoint/sessions/{sid}/v1", api_key="none", max_retries=0,
                       http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(svc, bodies))))


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_agent_calls_a_tool_through_the_endpoint(tokenizer, hermes, streamed):  # noqa: F811
    from examples.agents_sdk_agent import agents_sdk_agent, build_agent
    svc = scripted_service(tokenizer, hermes, ["ok " + CALL_TEXT, "\\boxed{15}"])
    bodies = []
    client = sdk_client(svc, bodies)

    async def go():
        if not streamed:
            return await agents_sdk_agent(client, {"prompt": "12+3="})
        run = agents.Runner.run_streamed(build_agent(client), "12+3=",
                                         run_config=agents.RunConfig(tracing_disabled=True))
        async for _ in run.stream_events():
            pass
        return run.final_output

    assert asyncio.run(go()) == "\\boxed{15}"
    assert [bool(b.get("stream")) for b in bodies] == [streamed] * 2
    assert [t["function"]["name"] for t in bodies[0]["tools"]] == ["calc"]
    tool_msg = bodies[1]["messages"][-1]
    assert tool_msg["role"] == "tool" and tool_msg["content"] == "15"  # the calculator ran on "12+3"
    session = svc.session("s")
    c0, c1 = session["calls"]
    assert c1["extends"] == 0 and len(session["samples"]) == 1


@pytest.fixture(scope="module")
def hermes_tok():
    return build_char_tokenizer("hermes")


@pytest.mark.parametrize("use_tool", [True, False])
def test_the_agents_episode_is_the_warm_starts_example_token_for_token(hermes_tok, use_tool):
    from areal_ray.reward.math import math_reward
    from areal_ray.task.tiny_model import encode_sft
    from examples.agents_sdk_agent import agents_sdk_agent
    p = tool_arith.ToolProblem(4821, "+", 3907)
    fmt = tool_arith.HermesCalls(hermes_tok)
    example = tool_arith.Example(fmt.prompt(p.prompt), fmt.segments(p, use_tool))
    eos = hermes_tok.eos_token
    said = [t.removesuffix(eos) for t, mine in example.segments if mine]  # the scripted app adds EOS
    svc = scripted_service(hermes_tok, ToolCallParser("hermes", hermes_tok), said)
    bodies = []
    answer = asyncio.run(agents_sdk_agent(sdk_client(svc, bodies), {"prompt": p.prompt}))
    assert answer == "\\boxed{8728}" and math_reward(answer, p.answer) == 1.0
    assert len(bodies) == 1 + use_tool

    (sample,) = svc.session("s")["samples"]
    ids, _, labels = encode_sft(hermes_tok, [example])
    want = ids[0].tolist()
    assert sample["prompt_ids"] + sample["output_ids"] == want
    n = len(sample["prompt_ids"])
    assert sample["loss_mask"] == [int(lab != -100) for lab in labels[0].tolist()[n:]]
    assert hermes_tok.decode(sample["prompt_ids"]) == "<tools>calc</tools>\n4821+3907="
    assert sample["tool_calls"] == int(use_tool)
