"""Tools and reading tool calls from text: exact arithmetic, the sandboxed Python tool,
call detection (complete, still open, none), and the errors a bad tool list gets."""

import asyncio

import pytest

from areal_ray.plugins import PluginError
from areal_ray.rollout.tools import (INCOMPLETE, Calculator, PythonTool, ToolCall, build_tools,
                                     calculate, find_call)


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
])
def test_calculate_errors_are_results_not_exceptions(expr, needle):
    out = calculate(expr)
    assert out.startswith("error:") and needle in out


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


def test_calculator_and_python_tools_answer_through_call():
    assert asyncio.run(Calculator().call("2+2")) == "4"
    tool = PythonTool()
    assert asyncio.run(tool.call("print(sum(range(10)))")) == "45"
    assert asyncio.run(tool.call("raise ValueError('boom')")).startswith("error: ValueError")


@pytest.mark.parametrize("specs, needle", [
    ([], "empty"), (["nope"], "nope"), ([3], "not a tool name"),
    (["calculator", "calculator"], "two tools"),
    (["areal_ray.rollout.tools.ToolCall"], "no method call"),
])
def test_bad_tool_lists_name_the_problem(specs, needle):
    with pytest.raises(PluginError, match=needle):
        build_tools(specs)


def test_builtin_tools_by_call_name():
    tools = build_tools(["calculator", "python"])
    assert sorted(tools) == ["calc", "python"]
