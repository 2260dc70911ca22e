"""Tools and reading tool calls from text: exact arithmetic, the calculator's bounds
against what a model may write, the sandboxed Python tool, running a call off the event
loop under a deadline (ToolRunner), call detection (complete, still open, none), and
the errors a bad tool list gets."""

import asyncio
import threading
import time

import pytest

from areal_ray.plugins import PluginError
from areal_ray.rollout.workflows.tools import (
    INCOMPLETE,
    MAX_RESULT_CHARS,
    Calculator,
    PythonTool,
    ToolCall,
    ToolRunner,
    build_tools,
    calculate,
    find_call,
)


@pytest.mark.parametrize("expr, want", [
    ("4821+3907", "8728"), ("1000-1", "999"), ("12*34", "408"), ("7/2", "3.5"),
    ("6/3", "2"), ("2**10", "1024"), ("-(3+4)*2", "-14"), (" 99 ", "99"), ("1/3", "0.333333"),
    ("123456789123*987654321", str(123456789123 * 987654321)),
])
def test_calculate_is_exact(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize("expr, needle", [
    ("1/0", "division by zero"), ("__import__('os')", "not arithmetic"),
    ("2**100000", "exponent"), ("4821+", "error"), ("abc", "not arithmetic"), ("", "error"),
    # what a policy wrote in training: the product's str() raised out of the tool
    ("(9**64)**64*(9**64)**64", "larger than 150 digits"),
    # a power tower: 9**(64**4) has 16 million digits (seconds of one C call, holding the GIL)
    ("(((9**64)**64)**64)**64", "larger than 150 digits"),
    ("((9**64)**64)**-64", "larger than 150 digits"),
    ("9**64**64", "exponent"),  # right-associative: the exponent 64**64 is refused
    ("1" * 200, "larger than 150 digits"), ("1" * 5000, "error"),  # literals
    ("2**0.5**-9999", "exponent"), ("1" + "+1" * 600, "longer than"),
    ("(-8)**0.5", "no real result"),
    ("1e308*10", "not a finite number (inf)"), ("1e999-1e999", "not a finite number (nan)"),
    ("-1e999", "not a finite number (-inf)"), ("1e300**2", "error"),
    ("(" * 250 + "1" + ")" * 250, "nested"),
])
def test_calculate_errors_are_results_not_exceptions(expr, needle):
    t0 = time.thread_time()  # this thread's CPU, not wall: a busy machine must not fail it, a big power must
    out = calculate(expr)
    assert time.thread_time() - t0 < 0.1, "refused before computing"
    assert out.startswith("error:") and needle in out and len(out) <= MAX_RESULT_CHARS


@pytest.mark.parametrize("expr, want", [
    ("(10**50)**2*10**49", "1" + "0" * 149),  # up to the bound: exact
    ("-(10**50)**2*10**49", "-1" + "0" * 149), ("2**64*2**64", str(2 ** 128)),
    ("1e20", "1e+20"), ("2.5e15+0.5", "2500000000000000.5"), ("1e14/4", "25000000000000"),
])
def test_calculate_answers_up_to_its_bounds(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize("text, want", [
    ("calc(4821+3907)", ToolCall("calc", "4821+3907")),
    ("let me see calc((1+2)*3)", ToolCall("calc", "(1+2)*3")),
    ("calc(1+2)=3\ncalc(3*4)", ToolCall("calc", "3*4")),
    ("calc((1+2)", INCOMPLETE),  # an inner `)`: generation goes on
    ("no call here)", None),
    ("calc(1)+2)", None),  # the call closed earlier; this `)` ends none
    ("xcalc(1+2)", None),  # another name that ends in `calc(`
    ("python(print(2**40))", ToolCall("python", "print(2**40)")),
])
def test_find_call(text, want):
    assert find_call(text, ["calc", "python"]) == want


@pytest.mark.usefixtures("available_sandbox")
def test_calculator_and_python_tools_answer_through_call():
    assert asyncio.run(Calculator().call("2+2")) == "4"
    tool = PythonTool()
    assert asyncio.run(tool.call("print(sum(range(10)))")) == "45"
    assert asyncio.run(tool.call("raise ValueError('boom')")).startswith("error: ValueError")


@pytest.mark.parametrize("program", [
    "import time\ntime.sleep(60)",  # idle: the wall-clock limit
    "while True:\n    pass",  # busy: the CPU limit, or the wall-clock one
])
@pytest.mark.usefixtures("available_sandbox")
def test_python_tool_is_bounded_in_time(program):
    tool = PythonTool(wall_s=1.0, cpu_s=1)
    t0 = time.perf_counter()
    out = asyncio.run(tool.call(program))
    assert out.startswith("error: timeout") and time.perf_counter() - t0 < 10


class Sleeper:
    """A tool that blocks its thread (as a careless tool would: no await) until released."""
    name = "sleeper"

    def __init__(self):
        self.release = threading.Event()

    async def call(self, arguments):
        self.release.wait(5.0)
        return "woke"


class Raiser:
    name = "raiser"

    def __init__(self, error):
        self.error = error

    async def call(self, arguments):
        raise self.error


class Returns:
    name = "returns"

    def __init__(self, value):
        self.value = value

    async def call(self, arguments):
        return self.value


async def with_ticks(coro):
    """`coro`'s result and the longest the event loop went without running another
    coroutine meanwhile (a tick every 10 ms)."""
    gaps, last, stop = [], time.perf_counter(), False

    async def tick():
        nonlocal last
        while not stop:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    ticker = asyncio.ensure_future(tick())
    try:
        return await coro, max(gaps, default=0.0)
    finally:
        stop = True
        await ticker


@pytest.mark.parametrize("tool, arguments, needle", [
    (Raiser(RuntimeError("kaput")), "", "error: raiser failed: RuntimeError: kaput"),
    (Raiser(KeyError("k")), "", "error: raiser failed: KeyError: 'k'"),
    (Raiser(SystemExit(3)), "", "error: raiser failed: SystemExit: 3"),
    (Raiser(RecursionError()), "", "error: raiser failed: RecursionError"),
    (Returns(10 ** 5000), "", "error: returns failed: ValueError: Exceeds the limit"),
    (Returns(float("nan")), "", "nan"), (Returns(None), "", "None"),
    (Returns("x" * 1000), "", "x" * MAX_RESULT_CHARS),
    (Calculator(), "(9**64)**64*(9**64)**64", "error: the result would be larger"),
    (Calculator(), "2+2", "4"),
])
def test_a_tool_call_ends_as_a_result_string(tool, arguments, needle):
    out = asyncio.run(ToolRunner(timeout_s=5.0).run(tool, arguments))
    assert isinstance(out, str) and out.startswith(needle) and len(out) <= MAX_RESULT_CHARS


def test_a_tool_that_overruns_times_out_while_the_event_loop_keeps_running():
    tool = Sleeper()
    runner = ToolRunner(timeout_s=0.3)
    try:
        t0 = time.perf_counter()
        out, gap = asyncio.run(with_ticks(runner.run(tool, "")))
        took = time.perf_counter() - t0
    finally:
        tool.release.set()
    assert out == "error: sleeper timed out after 0.3 s" and took < 2.0
    assert gap < 0.2, f"the event loop stalled for {gap:.2f} s"


def test_tool_calls_beyond_the_thread_bound_are_refused_not_queued():
    tool = Sleeper()
    runner = ToolRunner(timeout_s=0.2, max_threads=2)

    async def scenario():
        return await asyncio.gather(*[runner.run(tool, "") for _ in range(3)])
    try:
        outs = asyncio.run(scenario())
        assert sorted(outs) == ["error: sleeper refused: 2 tool calls are still running"] + \
            ["error: sleeper timed out after 0.2 s"] * 2
        assert runner.running == 2  # the overrun threads still run
    finally:
        tool.release.set()
    for _ in range(500):
        if runner.running == 0:
            break
        time.sleep(0.01)
    assert runner.running == 0 and asyncio.run(runner.run(Calculator(), "1+1")) == "2"


def test_a_tool_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        ToolRunner(timeout_s=0)


@pytest.mark.parametrize("specs, needle", [
    ([], "empty"), (["nope"], "nope"), ([3], "not a tool name"),
    (["calculator", "calculator"], "two tools"),
    (["areal_ray.rollout.workflows.tools.ToolCall"], "no method call"),
])
def test_bad_tool_lists_name_the_problem(specs, needle):
    with pytest.raises(PluginError, match=needle):
        build_tools(specs)


def test_builtin_tools_by_call_name():
    tools = build_tools(["calculator", "python"])
    assert sorted(tools) == ["calc", "python"]
