"""Tools a multi-turn workflow lets the model call, and how a call is read from its text.

A tool call is written `name(arguments)`, e.g. `calc(4821+3907)` or
`python(print(2**40))`. Generation stops at the call's closing `)` (one token: the
workflow passes it to the engine as a stop id), `find_call` decides whether the text
ends with a complete call (parentheses balanced since `name(`; a `)` inside the
arguments only pauses generation, which then continues), and the tool's result goes
back to the model as tokens of the trajectory that the policy did not sample.

A tool is any object with a `name` and `async call(arguments) -> str` (`Tool`). A
tool's failure is its result ("error: ..."), as it would be for an agent: the model
should learn from it, not the run crash. The arguments are whatever the policy wrote,
so no tool runs on the rollout's event loop: `ToolRunner` runs each call in a thread
of its own under a wall-clock bound, and turns an exception, an overrun or an odd
return value into a result. Built in: `calculator` (exact integer and decimal
arithmetic, no Python eval, sizes bounded before anything is computed) and `python`
(the program runs in the reward sandbox, areal_ray/reward/sandbox.py: no network,
read-only root, CPU/memory/wall-clock limits; its stdout is the result). Others by
dotted path (`rollout.workflow_kwargs.tools`).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import math
import operator
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from areal_ray.plugins import PluginError, import_class

MAX_RESULT_CHARS = 200  # a tool's output beyond this is cut: it becomes model context
MAX_EXPONENT = 64  # calc: larger powers are refused (a tool must answer quickly)
MAX_DIGITS = 150  # calc: the largest integer it reads, computes on the way, or returns
MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))
MAX_EXPRESSION_CHARS = 1000  # calc: longer input is refused before it is parsed

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


@runtime_checkable
class Tool(Protocol):
    name: str

    async def call(self, arguments: str) -> str:
        """The result the model reads (an error is a result, "error: ...")."""


def _int_bits(op: ast.operator, left: int, right: int) -> int:
    """An upper bound of the bits of `left op right` for integers, known before the
    operation runs: a power tower like ((9**64)**64)**64 is refused in microseconds
    instead of computing a number of millions of digits on the caller's thread."""
    a, b = left.bit_length(), right.bit_length()
    if isinstance(op, ast.Pow):
        return a * right if right > 0 else 1  # a negative exponent gives a float
    if isinstance(op, ast.Mult):
        return a + b
    if isinstance(op, (ast.Add, ast.Sub)):
        return max(a, b) + 1
    return max(a, b)  # / // %: never larger than their operands


def _number(value):
    if isinstance(value, complex):
        raise ValueError("no real result")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"a number larger than {MAX_DIGITS} digits")
    return value


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _number(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and not abs(right) <= MAX_EXPONENT:
            raise ValueError(f"exponent {right} is not within ±{MAX_EXPONENT}")
        if type(left) is int and type(right) is int and _int_bits(node.op, left, right) > MAX_BITS:
            raise ValueError(f"the result would be larger than {MAX_DIGITS} digits")
        return _number(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def _reason(e: BaseException) -> str:
    """The first line of what `e` says (its type when it says nothing)."""
    try:
        text = str(e).strip().splitlines()
    except Exception:  # noqa: BLE001 - a message that cannot be rendered
        text = []
    return text[0][:MAX_RESULT_CHARS] if text else type(e).__name__


def _format(value) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"error: the result is not a finite number ({value})"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        if abs(value) >= 1e15:
            return repr(value)  # 1e+300, not 301 digits of a float's binary expansion
        return f"{value:.6f}".rstrip("0").rstrip(".")
    return str(value)


def calculate(expression: str) -> str:
    """`expression` (numbers, + - * / // % ** and parentheses) evaluated exactly: an
    integer as digits, a float that is whole as an integer, else at most 6 decimals;
    "error: ..." for anything else, including numbers beyond MAX_DIGITS, exponents
    beyond MAX_EXPONENT and results that are not finite. Never raises."""
    try:
        if len(expression) > MAX_EXPRESSION_CHARS:
            return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
        return _format(_eval(ast.parse(expression.strip(), mode="eval").body))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {_reason(e)}"
    except Exception as e:  # noqa: BLE001 - deep nesting, memory: still a result
        return f"error: {type(e).__name__}: {_reason(e)}"


class Calculator:
    name = "calc"

    async def call(self, arguments: str) -> str:
        return calculate(arguments)


class PythonTool:
    """The arguments are a Python program; its stdout (or why it failed) is the result.
    Runs in the sandbox in a thread, so the event loop keeps serving other episodes;
    the sandbox kills the program at `wall_s` (and at `cpu_s` of CPU)."""
    name = "python"

    def __init__(self, wall_s: float = 4.0, cpu_s: int = 2, memory_mb: int = 256):
        from areal_ray.reward.sandbox import Limits
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_mb=memory_mb)

    async def call(self, arguments: str) -> str:
        from areal_ray.reward.sandbox import run_python
        res = await asyncio.to_thread(run_python, arguments, "", self.limits)
        if res.reason.startswith("timeout"):
            return f"error: {res.reason}"  # not the stderr of a program killed midway
        if res.reason != "ok":
            tail = res.stderr.strip().splitlines()[-1:] or [res.reason]
            return f"error: {tail[0]}"
        return res.stdout.rstrip("\n")


class ToolRunner:
    """Runs one tool call where what the call does cannot stall the rollout: in a
    thread of its own (with an event loop of its own for the tool's coroutine), awaited
    for at most `timeout_s`. A tool that blocks (sleeps, waits, loops in Python) stalls
    only its thread; the episode gets "error: ... timed out" and goes on, and the
    thread ends whenever the tool does. (One long C call that holds the GIL, such as a
    huge integer power, would still stall the process: hence the calculator's bounds,
    checked before computing, and the python tool's sandbox process.) At most
    `max_threads` calls run at once, overrun ones included: beyond that a call is
    refused at once rather than piling up threads behind a stuck tool.

    Every outcome is a string of at most MAX_RESULT_CHARS: a result, or "error: ..."
    for an exception (any: the model's arguments can make a tool raise anything), an
    overrun, or a refusal. A tool keeps no event-loop-bound state across calls (an
    HTTP client, a lock): each call runs on a fresh loop."""

    def __init__(self, timeout_s: float = 10.0, max_threads: int = 64):
        if not timeout_s > 0:
            raise ValueError(f"tool timeout must be > 0 s, got {timeout_s!r}")
        self.timeout_s, self.max_threads = timeout_s, max_threads
        self._lock = threading.Lock()
        self.running = 0  # calls whose thread has not ended (overrun ones included)

    @staticmethod
    def call_here(tool: Tool, arguments: str) -> str:
        """The call, run to its end in this thread; never raises."""
        try:
            out = tool.call(arguments)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            return (out if isinstance(out, str) else str(out))[:MAX_RESULT_CHARS]
        except BaseException as e:  # noqa: BLE001 - a worker thread: everything is a result
            return f"error: {tool.name} failed: {type(e).__name__}: {_reason(e)}"[:MAX_RESULT_CHARS]

    async def run(self, tool: Tool, arguments: str) -> str:
        with self._lock:
            if self.running >= self.max_threads:
                return (f"error: {tool.name} refused: {self.running} tool calls are still "
                        "running")
            self.running += 1
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def work() -> None:
            text = self.call_here(tool, arguments)
            with self._lock:
                self.running -= 1
            try:
                loop.call_soon_threadsafe(_resolve, done, text)
            except RuntimeError:  # the loop has closed: nobody waits for this call
                pass

        threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True).start()
        try:
            return await asyncio.wait_for(done, self.timeout_s)
        except TimeoutError:
            return f"error: {tool.name} timed out after {self.timeout_s:g} s"


async def _awaited(awaitable):
    return await awaitable


def _resolve(future: asyncio.Future, text: str) -> None:
    if not future.done():  # cancelled by an overrun, or by an abandoned episode
        future.set_result(text)


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
