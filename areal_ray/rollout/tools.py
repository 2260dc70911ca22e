"""Tools a multi-turn workflow lets the model call, and how a call is read from its text.

A tool call is written `name(arguments)`, e.g. `calc(4821+3907)` or
`python(print(2**40))`. Generation stops at the call's closing `)` (one token: the
workflow passes it to the engine as a stop id), `find_call` decides whether the text
ends with a complete call (parentheses balanced since `name(`; a `)` inside the
arguments only pauses generation, which then continues), and the tool's result goes
back to the model as tokens of the trajectory that the policy did not sample.

A tool is any object with a `name` and `async call(arguments) -> str` (`Tool`). A
tool's failure is its result ("error: ..."), as it would be for an agent: the model
should learn from it, not the run crash. Built in: `calculator` (exact integer and
decimal arithmetic, no Python eval) and `python` (the program runs in the reward
sandbox, areal_ray/reward/sandbox.py: no network, read-only root, CPU/memory limits;
its stdout is the result). Others by dotted path (`rollout.workflow_kwargs.tools`).
"""

from __future__ import annotations

import ast
import asyncio
import operator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from areal_ray.plugins import PluginError, import_class

MAX_RESULT_CHARS = 200  # a tool's output beyond this is cut: it becomes model context
MAX_EXPONENT = 64  # calc: larger powers are refused (a tool must answer quickly)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@runtime_checkable
class Tool(Protocol):
    name: str

    async def call(self, arguments: str) -> str:
        """The result the model reads (an error is a result, "error: ...")."""


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """`expression` (numbers, + - * / // % ** and parentheses) evaluated exactly: an
    integer as digits, a float that is whole as an integer, else at most 6 decimals;
    "error: ..." for anything else."""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.6f}".rstrip("0").rstrip(".")
    return str(value)


class Calculator:
    name = "calc"

    async def call(self, arguments: str) -> str:
        return calculate(arguments)


class PythonTool:
    """The arguments are a Python program; its stdout (or why it failed) is the result.
    Runs in the sandbox in a thread, so the event loop keeps serving other episodes."""
    name = "python"

    def __init__(self, wall_s: float = 4.0, cpu_s: int = 2, memory_mb: int = 256):
        from areal_ray.reward.sandbox import Limits
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)

    async def call(self, arguments: str) -> str:
        from areal_ray.reward.sandbox import run_python
        res = await asyncio.to_thread(run_python, arguments, "", self.limits)
        if res.reason != "ok":
            tail = res.stderr.strip().splitlines()[-1:] or [res.reason]
            return f"error: {tail[0]}"
        return res.stdout.rstrip("\n")


BUILTIN_TOOLS = {"calculator": Calculator, "python": PythonTool}


def build_tools(specs: list) -> dict[str, Tool]:
    """Tools by call name from `specs`: built-in names (BUILTIN_TOOLS) or dotted paths
    of Tool classes built without arguments. PluginError naming the spec otherwise."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if not isinstance(spec, str):
            raise PluginError(f"rollout.workflow_kwargs.tools: {spec!r} is not a tool name "
                              f"({sorted(BUILTIN_TOOLS)}) or a dotted class path")
        cls = BUILTIN_TOOLS.get(spec) or import_class(
            spec, "rollout.workflow_kwargs.tools", "call", coroutine=True)
        tool = cls()
        name = getattr(tool, "name", "")
        if not isinstance(name, str) or not name.isidentifier():
            raise PluginError(f"tool {spec!r}: `name` must be an identifier, got {name!r}")
        if name in tools:
            raise PluginError(f"two tools are called {name!r}")
        tools[name] = tool
    if not tools:
        raise PluginError("rollout.workflow_kwargs.tools is empty: a tool workflow needs a tool")
    return tools


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str


INCOMPLETE = object()  # a call was opened and its parentheses are not closed yet


def find_call(text: str, names) -> ToolCall | object | None:
    """The tool call `text` ends with; INCOMPLETE when the last call opened is still
    open (generation should go on); None when the text ends in no call."""
    best = -1
    for name in names:
        at = text.rfind(name + "(")
        while at > 0 and (text[at - 1].isalnum() or text[at - 1] == "_"):
            at = text.rfind(name + "(", 0, at)  # `xcalc(` is not `calc(`
        if at > best:
            best, found = at, name
    if best < 0:
        return None
    args = text[best + len(found) + 1:]
    depth = 1
    for i, ch in enumerate(args):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return ToolCall(found, args[:i]) if i == len(args) - 1 else None
    return INCOMPLETE
