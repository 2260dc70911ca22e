"""code_reward / run_tests: extraction, all-or-nothing reward, counts and reasons."""

import pytest

from areal_ray.reward.code import CodeResult, code_reward, extract_code, run_tests

TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"}]
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def fenced(code, lang="python"):
    return f"Here you go:\n```{lang}\n{code}```\n"


def test_correct_program_gets_reward_one():
    res = code_reward(fenced(ADD), TESTS)
    assert (res.reward, res.passed, res.total) == (1.0, 2, 2)
    assert res.reason.startswith("all passed")


def test_last_block_wins_and_thinking_is_skipped():
    text = "<think>" + fenced("print(0)") + "</think>" + fenced("print(1)") + fenced(ADD, "")
    assert extract_code(text) == ADD


def test_partial_pass_is_zero_reward_with_counts():
    res = run_tests("a, b = map(int, input().split())\nprint(7)\n", TESTS)
    assert (res.reward, res.passed, res.total) == (0.0, 1, 2)
    assert "test 1: wrong answer" in res.reason


@pytest.mark.parametrize("code,reason", [
    ("while True: pass", "timeout"),
    ("raise SystemExit(3)", "exit 3"),
    ("import sys; sys.stdout.write('x' * 10_000_000)", "output limit"),
])
def test_failures_are_zero_with_a_reason(code, reason):
    res = run_tests(code, TESTS, time_limit_s=1.0)
    assert res.reward == 0.0 and reason in res.reason


def test_no_code_and_bad_tests():
    assert code_reward("no code here", TESTS) == CodeResult(0.0, 0, 2, "no fenced code block")
    with pytest.raises(ValueError, match="test 0 must be"):
        run_tests(ADD, [{"input": 1}])
    with pytest.raises(ValueError, match="non-empty list"):
        run_tests(ADD, [])
