"""Code rewards: run model-written Python against stdin/stdout tests, in the sandbox.

Tests use the LiveCodeBench / CodeContests format, `{"input": str, "output": str}`;
outputs are compared line by line with trailing whitespace ignored. The reward is
1.0 only when every test passes. A timeout stops the run at that test (the rest count
as failed), so a looping program costs one time limit, and a check at most
`len(tests) * time_limit_s`. Each test is a fresh sandboxed process (sandbox.py);
`sandbox` is the mode of `reward.sandbox` (None: the sandbox's default, which fails
closed). Without the isolation it asks for, nothing runs: `SandboxUnavailable`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

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


def _same(got: str, want: str) -> bool:
    norm = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def check_tests(tests: object) -> list[dict]:
    if not isinstance(tests, list) or not tests:
        raise ValueError("tests must be a non-empty list of {'input': str, 'output': str}")
    for i, t in enumerate(tests):
        if not (isinstance(t, dict) and isinstance(t.get("input"), str)
                and isinstance(t.get("output"), str)):
            raise ValueError(f"test {i} must be {{'input': str, 'output': str}}, got {t!r:.80}")
    return tests


def run_tests(code: str, tests: list[dict], time_limit_s: float = 2.0,
              memory_limit_mb: int = 512, sandbox: str | None = None) -> CodeResult:
    tests = check_tests(tests)
    if not isinstance(code, str) or not code.strip():
        return CodeResult(0.0, 0, len(tests), "no code")
    if len(code) > MAX_CODE_CHARS:
        return CodeResult(0.0, 0, len(tests), f"code longer than {MAX_CODE_CHARS} chars")
    limits = Limits(wall_s=time_limit_s, cpu_s=max(1, int(time_limit_s + 0.999)),
                    memory_mb=memory_limit_mb, sandbox=sandbox or default_mode())
    isolated = isolation(limits.sandbox)  # refused here, before any test runs
    passed, reason = 0, "all passed"
    for i, t in enumerate(tests):
        res = run_python(code, t["input"], limits)
        if res.reason == "ok" and _same(res.stdout, t["output"]):
            passed += 1
            continue
        if reason == "all passed":
            detail = "wrong answer" if res.reason == "ok" else res.reason
            reason = f"test {i}: {detail}"
        if res.reason == "timeout":
            break
    reward = 1.0 if passed == len(tests) else 0.0
    return CodeResult(reward, passed, len(tests), f"{reason} [{isolated}]")


def code_reward(response: str, tests: list[dict], time_limit_s: float = 2.0,
                memory_limit_mb: int = 512, sandbox: str | None = None) -> CodeResult:
    code = extract_code(response) if isinstance(response, str) else None
    if code is None:
        return CodeResult(0.0, 0, len(check_tests(tests)), "no fenced code block")
    return run_tests(code, tests, time_limit_s, memory_limit_mb, sandbox)


class CodeChecker:
    """The built-in `code` verifier (reward/registry.py): `answer` is the JSON list of
    tests; `opts` may set `time_limit_s` and `memory_limit_mb` per test, and `sandbox`
    (reward.sandbox)."""

    def check(self, text: str, answer: str, opts: dict | None = None) -> tuple[float, str]:
        opts = opts or {}
        res = code_reward(text, json.loads(answer), opts.get("time_limit_s", 2.0),
                          opts.get("memory_limit_mb", 512), opts.get("sandbox"))
        return res.reward, f"{res.passed}/{res.total} tests: {res.reason}"
