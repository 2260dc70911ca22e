"""The calculator task as an OpenAI Agents SDK agent (`openai-agents`): an `Agent` with
the calculator as a `@function_tool`, run by `Runner.run`. Run it as a rollout
workflow with conf/agents_sdk.yaml:

    rollout.workflow=areal_ray.rollout.workflows.agent.AgentWorkflow
    rollout.workflow_kwargs={agent: examples.agents_sdk_agent.agents_sdk_agent}
    rollout.openai.enabled=true

The endpoint renders the tool with the model's chat template, parses the model's calls
into `tool_calls` by `rollout.openai.tool_parser` (hermes: `<tool_call>{json}</tool_call>`,
as Qwen writes them), the SDK runs `calc` and sends its result back as a `role: tool`
message, and the session records one trajectory (the model's tokens in the loss, the
tool's out). The model must write the parser's format: a Qwen model, or the tiny model
warm-started in it (artifacts/tiny-agents).

What the SDK needs here, as against any OpenAI-compatible server that is not OpenAI's:
a model over the workflow's own client (its key, no retries), and tracing off (it would
export to OpenAI's platform). This example uses the Chat Completions API
(`OpenAIChatCompletionsModel`); the SDK's default, the Responses API, is served too
(areal_ray/rollout/openai/responses.py: the same session, the same recorded tokens).
"""

from __future__ import annotations

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
)

from areal_ray.task.tool_arith import calc

MODEL = "policy"  # the endpoint serves the run's model under any name
MAX_TOOL_CALLS = 4


def build_agent(client) -> Agent:
    # No instructions (they would be a system message the tiny model never saw) and no
    # model settings: temperature and max_tokens are the episode's (the session's defaults).
    return Agent(name="calculator", tools=[function_tool(calc)],
                 model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))


async def agents_sdk_agent(client, row: dict) -> str | None:
    """Answer `row["prompt"]`; the final output (holding `\\boxed{...}`) is what the
    reward checker grades. A model that keeps calling tools past MAX_TOOL_CALLS, or calls
    one the agent does not have, answered wrong: "" (reward 0; its calls still train)."""
    try:
        result = await Runner.run(build_agent(client), str(row["prompt"]), max_turns=MAX_TOOL_CALLS + 1,
                                  run_config=RunConfig(tracing_disabled=True))
    except (MaxTurnsExceeded, ModelBehaviorError):
        return ""
    return str(result.final_output or "")
