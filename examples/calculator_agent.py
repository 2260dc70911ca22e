"""A calculator agent written only against the `openai` client: run it as a rollout
workflow with

    rollout.workflow=areal_ray.rollout.agent_workflow.AgentWorkflow
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

import ast
import operator

MODEL = "policy"  # the endpoint serves the run's model under any name
MAX_TOOL_CALLS = 4
TOOL = "calc"

try:  # the repository's calculator (exact arithmetic, no eval)
    from areal_ray.rollout.tools import calculate
except ImportError:  # not in this checkout: a small safe evaluator of the same contract
    _OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv}

    def _eval(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = _eval(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    def calculate(expression: str) -> str:
        try:
            value = _eval(ast.parse(expression.strip(), mode="eval").body)
        except ZeroDivisionError:
            return "error: division by zero"
        except (SyntaxError, ValueError, TypeError, OverflowError) as e:
            return f"error: {e}"
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)


def tool_call(text: str) -> str | None:
    """The arguments of the `calc(...)` call `text` ends with, if it ends with a
    complete one (parentheses balanced since `calc(`)."""
    at = text.rfind(TOOL + "(")
    if at < 0 or not text.endswith(")"):
        return None
    args, depth = text[at + len(TOOL) + 1:], 1
    for i, ch in enumerate(args):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return args[:i] if i == len(args) - 1 else None
    return None


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
        args = tool_call(content) if resp.choices[0].finish_reason == "stop" else None
        if args is None:
            if content.endswith(")") and resp.choices[0].finish_reason == "stop" \
                    and content.rfind(TOOL + "(") >= 0:
                continue  # a `)` inside the call's arguments: let the model go on
            return transcript
        result = "=" + calculate(args) + "\n"
        messages.append({"role": "tool", "content": result})
        transcript += result
    return transcript
