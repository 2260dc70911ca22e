"""code_reward / run_tests: extraction, all-or-nothing reward, counts and reasons; no
code runs without the isolation `reward.sandbox` asks for. The programs run under
bubblewrap where it is installed, else in the explicit rlimits mode."""

import json

import pytest

from areal_ray.reward import sandbox
from areal_ray.reward.code import CodeChecker, CodeResult, code_reward, extract_code, run_tests
from areal_ray.reward.sandbox import SandboxUnavailable

# the calls below name no mode: they get the environment's (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("available_sandbox")


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


# Only the timeout case needs a short limit: with 1 s for all, a loaded full suite once
# timed out the sandboxed start of the exit-3 program before it exited.
@pytest.mark.parametrize("code,reason,limit_s", [
    ("while True: pass", "timeout", 1.0),
    ("raise SystemExit(3)", "exit 3", 30.0),
    ("import sys; sys.stdout.write('x' * 10_000_000)", "output limit", 30.0),
])
def test_failures_are_zero_with_a_reason(code, reason, limit_s):
    res = run_tests(code, TESTS, time_limit_s=limit_s)
    assert res.reward == 0.0 and reason in res.reason


def test_no_code_and_bad_tests():
    assert code_reward("no code here", TESTS) == CodeResult(0.0, 0, 2, "no fenced code block")
    with pytest.raises(ValueError, match="test 0 must be"):
        run_tests(ADD, [{"input": 1}])
    with pytest.raises(ValueError, match="non-empty list"):
        run_tests(ADD, [])


@pytest.mark.parametrize("mode", ["auto", "bwrap"])
def test_without_isolation_no_code_runs(monkeypatch, tmp_path, mode):
    """Fail closed: the check raises (the reward pool records it as a checker error,
    reward 0) before any test runs, naming the package to install."""
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        run_tests(ADD, TESTS, sandbox=mode)
    with pytest.raises(SandboxUnavailable):
        CodeChecker().check(fenced(ADD), json.dumps(TESTS), {"sandbox": mode})
    assert code_reward("no code here", TESTS, sandbox=mode).reason == "no fenced code block"


def test_the_checker_runs_in_the_mode_it_is_given(monkeypatch):
    monkeypatch.setattr(sandbox, "BWRAP", "/nonexistent/bwrap")
    monkeypatch.delenv(sandbox.ENV)
    reward, reason = CodeChecker().check(fenced(ADD), json.dumps(TESTS), {"sandbox": "rlimits"})
    assert (reward, reason) == (1.0, "2/2 tests: all passed [rlimits-only]")
