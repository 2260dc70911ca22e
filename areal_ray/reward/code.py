"""Code rewards: run model-written Python against a problem's tests, in the sandbox.

A row's tests come in the shape its source publishes (code_tests.py): stdin/stdout
pairs `{"input": str, "output": str}` (ours, CodeContests'), LiveCodeBench's (stdin and
"functional" calls), APPS/TACO's `input_output` (stdin, or calls of `fn_name`),
HumanEval's `check(candidate)` and MBPP's asserts. Stdout is compared line by line
with trailing whitespace ignored (LiveCodeBench and APPS: lines stripped, numbers by
value). The reward is 1.0 only when every test passes. A timeout stops the run at that
test (the rest count as failed), so a looping program costs one time limit, and a
check at most `len(tests) * time_limit_s`. Each test is a fresh sandboxed process
(sandbox.py); `sandbox` is the mode of `reward.sandbox` (None: the sandbox's default,
which fails closed). Without the isolation it asks for, nothing runs:
`SandboxUnavailable`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from areal_ray.reward.code_tests import checked, judge, parse, script
from areal_ray.reward.sandbox import Limits, default_mode, isolation, run_python

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_CODE_CHARS = 100_000


@dataclass
class CodeResult:
    reward: float
    passed: int
    total: int
    reason: str


def extract_code(response: str) -> str | None:
    """The last fenced code block (```python ... ``` or a bare ```)."""
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


# A row's `tests`, checked, as its `answer` holds them; ValueError naming what is wrong.
check_tests = checked


def run_tests(code: str, tests: object, time_limit_s: float = 2.0,
              memory_limit_mb: int = 512, sandbox: str | None = None) -> CodeResult:
    suite = parse(tests)
    total = len(suite.cases)
    if not isinstance(code, str) or not code.strip():
        return CodeResult(0.0, 0, total, "no code")
    if len(code) > MAX_CODE_CHARS:
        return CodeResult(0.0, 0, total, f"code longer than {MAX_CODE_CHARS} chars")
    limits = Limits(wall_s=time_limit_s, cpu_s=max(1, int(time_limit_s + 0.999)),
                    memory_mb=memory_limit_mb, sandbox=sandbox or default_mode())
    isolated = isolation(limits.sandbox)  # refused here, before any test runs
    passed, reason = 0, "all passed"
    for i, case in enumerate(suite.cases):
        program, stdin, nonce = script(suite, case, code)
        res = run_python(program, stdin, limits)
        failed = judge(suite, case, res, nonce)
        if failed is None:
            passed += 1
            continue
        if reason == "all passed":
            reason = f"test {i}: {failed}"
        if res.reason == "timeout":
            break
    reward = 1.0 if passed == total else 0.0
    return CodeResult(reward, passed, total, f"{reason} [{isolated}]")


def code_reward(response: str, tests: object, time_limit_s: float = 2.0,
                memory_limit_mb: int = 512, sandbox: str | None = None) -> CodeResult:
    code = extract_code(response) if isinstance(response, str) else None
    if code is None:
        return CodeResult(0.0, 0, len(parse(tests).cases), "no fenced code block")
    return run_tests(code, tests, time_limit_s, memory_limit_mb, sandbox)


class CodeChecker:
    """The built-in `code` verifier (reward/registry.py): `answer` is the row's tests
    as JSON (check_tests); `opts` may set `time_limit_s` and `memory_limit_mb` per
    test, and `sandbox` (reward.sandbox)."""

    def check(self, text: str, answer: str, opts: dict | None = None) -> tuple[float, str]:
        opts = opts or {}
        res = code_reward(text, json.loads(answer), opts.get("time_limit_s", 2.0),
                          opts.get("memory_limit_mb", 512), opts.get("sandbox"))
        return res.reward, f"{res.passed}/{res.total} tests: {res.reason}"
