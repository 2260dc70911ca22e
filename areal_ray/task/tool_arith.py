"""The embedded tool-use task: large additions and subtractions, with a calculator.

A problem is `4821+3907=` (two operands of 3 or 4 digits, `+` or `-`, the result never
negative). There are two ways to answer:

    tool:    calc(4821+3907)=8728\\n\\boxed{8728}
    direct:  \\boxed{8728}

In the tool solution the model writes `calc(4821+3907)`; generation stops at `)`, the
rollout workflow (areal_ray/rollout/workflows/tool.py) runs the calculator and appends
its result as `=8728\\n` (RESULT_FORMAT). Those tokens are the tool's, not the
policy's: they are in the trajectory with loss mask 0, and in the warm start's labels
they are masked out the same way (`encode`). The model then copies the result into
`\\boxed{}` and ends. Both moves are copying, which even a tiny model learns exactly.

A direct answer asks the model to add two 4-digit numbers in its head, most
significant digit first, with a 0.65M-parameter character-level model: it gets a
digit or two right and the answer is almost always wrong. So a model that knows the
call format but has the *habit* of answering directly (the warm start,
areal_ray/task/tiny_model.py) scores low, and RL has one clear thing to learn: call
the tool. The decision is made at the first output token (`c` or `\\`), and every
sampled call is rewarded, so greedy accuracy and the tool-use rate rise together
within minutes on a CPU: the agentic-rollout counterpart of the arithmetic task's
"work it out".

The reward is the ordinary `math` verifier on the decoded output (its last
`\\boxed{}`); the tool-result tokens are in the output it reads, which does not
matter: only the box is graded. Everything is generated from a seed.

Agent frameworks call the calculator as a function tool through the OpenAI endpoint,
so their model writes a real model family's call format instead (HermesCalls below,
artifacts/tiny-agents, conf/agents_sdk.yaml):

    <tools>calc</tools>\\n4821+3907=<tool_call>\\n{"name": "calc", "arguments": {"expr":
    "4821+3907"}}\\n</tool_call></s><tool_response>\\n8728\\n</tool_response>\\n\\boxed{8728}

the prompt and the result rendered by the `hermes` char tokenizer's chat template, the
call parsed by the endpoint's parser. Same problems, same held-out set, same reward.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PROMPT_SUFFIX = "="
TOOL = "calc"
CALL_END = ")"
RESULT_FORMAT = "={}\n"  # how the workflow writes a tool's result back (rollout.workflow_kwargs)
LOW, HIGH = 100, 9999  # operands: 3 or 4 digits


@dataclass(frozen=True)
class ToolProblem:
    a: int
    op: str  # "+" or "-"
    b: int

    @property
    def expr(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def prompt(self) -> str:
        return self.expr + PROMPT_SUFFIX

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)

    def to_row(self, uid: str) -> dict:
        return {"uid": uid, "prompt": self.prompt, "answer": self.answer, "verifier": "math",
                "op": self.op}


def make_problem(rng: random.Random) -> ToolProblem:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    op = rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    return ToolProblem(a, op, b)


def make_split(seed: int, n: int) -> list[ToolProblem]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def boxed(answer: str) -> str:
    return "\\boxed{" + answer + "}"


def call_text(expr: str) -> str:
    return f"{TOOL}({expr}{CALL_END}"


def segments(p: ToolProblem, use_tool: bool) -> tuple[tuple[str, bool], ...]:
    """The solution as (text, written by the model) pieces; EOS follows the last."""
    if not use_tool:
        return ((boxed(p.answer), True),)
    return ((call_text(p.expr), True), (RESULT_FORMAT.format(p.answer), False),
            (boxed(p.answer), True))


def render(parts: tuple[tuple[str, bool], ...]) -> tuple[str, list[int]]:
    """The output text and its per-character label mask (1: the model's, 0: the tool's).
    The tokenizer is one token per character, so this is also the per-token mask."""
    text = "".join(t for t, _ in parts)
    mask = [int(mine) for t, mine in parts for _ in t]
    return text, mask


@dataclass(frozen=True)
class Example:
    """One warm-start example: prompt and solution segments (tiny_model.encode_sft)."""
    prompt: str
    segments: tuple[tuple[str, bool], ...]


# How the model writes a call and reads its result: the embedded `calc(...)` format,
# or Hermes / Qwen2.5's <tool_call> JSON through the chat template (HermesCalls). ---------

class CalcCalls:
    """`calc(4821+3907)`, generation stopping at `)`, the result appended as `=8728\\n`:
    the format of conf/tools.yaml's ToolWorkflow (and of examples/calculator_agent.py)."""
    call_prefix = f"{TOOL}("
    turn_tokens = 24  # `calc(4821+3907)` is 15 tokens, `\boxed{12728}` + EOS 14

    def prompt(self, prompt: str) -> str:
        return prompt

    def segments(self, p: ToolProblem, use_tool: bool) -> tuple[tuple[str, bool], ...]:
        return segments(p, use_tool)

    def stop_ids(self, tok) -> list[int]:
        return [tok.eos_token_id, tok.convert_tokens_to_ids(CALL_END)]

    def after_turn(self, turn: str, ended_eos: bool) -> str | None:
        """The tool's text to append after a turn that ends in a complete call, else None."""
        from areal_ray.rollout.workflows.tools import ToolCall, calculate, find_call  # the workflow's own
        call = None if ended_eos else find_call(turn, (TOOL,))
        return RESULT_FORMAT.format(calculate(call.arguments)) if isinstance(call, ToolCall) else None


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression such as 4821+3907."""
    from areal_ray.rollout.workflows.tools import calculate
    return calculate(expr)


# `calc` as an OpenAI tool: what an agent framework sends for it (only the name is rendered)
TOOL_SPEC = {"type": "function", "function": {
    "name": TOOL, "description": calc.__doc__,
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


class HermesCalls:
    """Hermes / Qwen2.5's format, as an agent framework's `calc` function tool is called
    through the OpenAI endpoint (conf/agents_sdk.yaml): the prompt, the tool's result
    and any history are the chat template's rendering (render_chat, the endpoint's);
    the model writes `<tool_call>\\n{"name": "calc", "arguments": {"expr": "4821+3907"}}
    \\n</tool_call>` (json.dumps' spacing: the template's `tojson` re-renders it
    identically) and ends its turn with EOS, which stays in the token stream (the
    endpoint continues the sampled ids); the endpoint's parser (vLLM's hermes) reads
    the call, the framework runs `calc` and sends its result back as a `tool` message."""
    call_prefix = "<tool_call>"
    turn_tokens = 80  # the call is 68 tokens + EOS for 4-digit operands

    def __init__(self, tok, parser: str = "hermes"):
        from areal_ray.rollout.openai.tool_calls import ToolCallParser
        self.tok, self.parser = tok, ToolCallParser(parser, tok)
        self._request = None

    def prompt(self, prompt: str) -> str:
        from areal_ray.rollout.openai.protocol import render_chat
        return render_chat(self.tok, [{"role": "user", "content": prompt}], [TOOL_SPEC])

    def call_text(self, expr: str) -> str:
        import json
        return "<tool_call>\n" + json.dumps({"name": TOOL, "arguments": {"expr": expr}}) + "\n</tool_call>"

    def result_text(self, result: str) -> str:
        """What the template appends for a `tool` message after a turn of the model's."""
        from areal_ray.rollout.openai.protocol import render_chat
        turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        head = render_chat(self.tok, turn, [TOOL_SPEC])
        full = render_chat(self.tok, turn + [{"role": "tool", "content": result}], [TOOL_SPEC])
        if not full.startswith(head):
            raise ValueError("the chat template does not append a tool's result after the turn before it")
        return full[len(head):]

    def segments(self, p: ToolProblem, use_tool: bool) -> tuple[tuple[str, bool], ...]:
        if not use_tool:
            return ((boxed(p.answer), True),)
        return ((self.call_text(p.expr) + self.tok.eos_token, True),
                (self.result_text(p.answer), False), (boxed(p.answer), True))

    def stop_ids(self, tok) -> list[int]:
        return [tok.eos_token_id]

    def after_turn(self, turn: str, ended_eos: bool) -> str | None:
        """EOS (the model's, kept) and the result of each call the parser finds in `turn`."""
        import json
        if not ended_eos:
            return None
        if self._request is None:
            self._request = self.parser.request([TOOL_SPEC], "auto")
        calls = self.parser.parse(turn, self._request, 0, []).tool_calls
        if not calls:
            return None
        results = []
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            ok = c["function"]["name"] == TOOL and isinstance(args, dict) and isinstance(args.get("expr"), str)
            results.append(self.result_text(calc(args["expr"]) if ok else "error: not a calc(expr) call"))
        return self.tok.eos_token + "".join(results)


def call_format(name: str, tok):
    if name == "calc":
        return CalcCalls()
    if name == "hermes":
        return HermesCalls(tok)
    raise ValueError(f"call_format {name!r} is not one of ['calc', 'hermes']")


def examples(rng: random.Random, n: int, p_direct: float, fmt=None) -> list[Example]:
    """`n` fresh problems, each solved directly with probability `p_direct`, else with the tool."""
    fmt = fmt or CalcCalls()
    out = []
    for _ in range(n):
        p = make_problem(rng)
        out.append(Example(fmt.prompt(p.prompt), fmt.segments(p, use_tool=rng.random() >= p_direct)))
    return out


# The rollout workflow's view of a turn, for the warm start's own multi-turn check. ------

def generate_with_tool(model, tok, prompts: list[str], max_turns: int = 3,
                       turn_tokens: int | None = None, greedy: bool = True,
                       prefix: str = "", fmt=None) -> list[str]:
    """Outputs (tool results included) of `prompts` (as `fmt` renders them), turn by
    turn like the workflow: generate until a stop of `fmt` (`)` or EOS; EOS), append
    the result of the call the turn ends in, go on. `prefix`: what every output is made
    to start with (the call's start forces the tool, `\\boxed{` a direct answer)."""
    import torch

    fmt = fmt or CalcCalls()
    stop = fmt.stop_ids(tok)
    outs = [prefix for _ in prompts]
    active, turns, turn_start = list(range(len(prompts))), [1] * len(prompts), [0] * len(prompts)
    model.eval()
    while active:
        enc = tok([prompts[i] + outs[i] for i in active], add_special_tokens=False,
                  padding=True, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=not greedy, max_new_tokens=turn_tokens or fmt.turn_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=stop)
        new = gen[:, enc["input_ids"].shape[1]:].tolist()
        still = []
        for i, ids in zip(active, new):
            ended_eos = tok.eos_token_id in ids
            ids = ids[: ids.index(tok.eos_token_id)] if ended_eos else ids
            ids = [t for t in ids if t != tok.pad_token_id]
            outs[i] += tok.decode(ids, skip_special_tokens=True)
            result = fmt.after_turn(outs[i][turn_start[i]:], ended_eos)
            if result is not None and turns[i] < max_turns:
                outs[i] += result
                turns[i] += 1
                turn_start[i] = len(outs[i])
                still.append(i)
        active = still
    return outs


def uses_tool(output: str, fmt=None) -> bool:
    return output.startswith((fmt or CalcCalls()).call_prefix)


def tool_accuracy(model, tok, problems: list[ToolProblem], prefix: str = "",
                  max_turns: int = 3, fmt=None) -> tuple[float, float]:
    """(greedy accuracy, tool-use rate) on `problems`, multi-turn as RL sees them."""
    from areal_ray.reward.math import math_reward

    fmt = fmt or CalcCalls()
    outs = generate_with_tool(model, tok, [fmt.prompt(p.prompt) for p in problems], max_turns=max_turns,
                              prefix=prefix, fmt=fmt)
    n = len(problems)
    acc = sum(math_reward(o, p.answer) for o, p in zip(outs, problems)) / n
    return acc, sum(uses_tool(o, fmt) for o in outs) / n
