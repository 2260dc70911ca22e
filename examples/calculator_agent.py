"""A calculator agent written only against the `openai` client: run it as a rollout
workflow with

    rollout.workflow=areal_ray.rollout.workflows.agent.AgentWorkflow
    rollout.workflow_kwargs={agent: examples.calculator_agent.calculator_agent}
    rollout.openai.enabled=true

The embedded tool task's format: the prompt is like `4821+3907=`; the model writes a
call `calc(4821+3907)` and generation stops at `)` (one token, so a valid stop
string); the tool's result goes back as `=8728\n`; the model then writes
`\\boxed{8728}` and ends. With the embedded tokenizer's chat template (contents
concatenated in order), the messages below render to exactly that token stream, and
the endpoint records it as one training Sample: the model's text with loss mask 1,
the tool results with mask 0.

Nothing here knows about training: the same function runs against any
OpenAI-compatible server.
"""

from __future__ import annotations

from areal_ray.rollout.workflows.tools import ToolCall, calculate, find_call

MODEL = "policy"  # the endpoint serves the run's model under any name
MAX_TOOL_CALLS = 4
TOOL = "calc"


async def calculator_agent(client, row: dict) -> str | None:
    """Answer `row["prompt"]`, calling the calculator when the model asks; returns
    everything after the prompt (the model's text and the tool results), which holds
    the final `\\boxed{...}` the reward checker grades."""
    messages = [{"role": "user", "content": str(row["prompt"])}]
    transcript = ""
    for _ in range(MAX_TOOL_CALLS + 1):
        # No max_tokens / temperature: the endpoint uses the run's rollout settings.
        resp = await client.chat.completions.create(model=MODEL, messages=messages, stop=[")"])
        content = resp.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": content})
        transcript += content
        call = find_call(content, [TOOL]) if resp.choices[0].finish_reason == "stop" else None
        if not isinstance(call, ToolCall):
            if call is not None:  # a `)` inside the call's arguments: let the model go on
                continue
            return transcript
        result = "=" + calculate(call.arguments) + "\n"
        messages.append({"role": "tool", "content": result})
        transcript += result
    return transcript
