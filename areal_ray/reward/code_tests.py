"""Code tests as the public code datasets publish them, read into one spec and run as
small harness programs in the sandbox (sandbox.py, its limits unchanged).

A code row's `tests` takes one shape per source (docs/data.md, "Code tasks"):
  stdin          [{"input": str, "output": str}, ...]: ours, CodeContests' style
  livecodebench  {"format": "livecodebench", "public_test_cases", "private_test_cases",
                  "metadata"}: LiveCodeBench's columns, tests of testtype "stdin" or
                  "functional" (a call of metadata's func_name)
  apps           {"format": "apps", "input_output"}: APPS and TACO (alias "taco"); with
                  `fn_name` the tests are calls, without it stdin/stdout
  humaneval      {"format": "humaneval", "prompt", "test", "entry_point"}: the test's
                  check(candidate) is called on the program's entry point
  mbpp           {"format": "mbpp", "test_list", "test_setup_code" or "test_imports"}:
                  each assert is a test
Each is graded as its own benchmark's grader grades it: a call test passes when the
returned value equals the expected one (a tuple counting as a list; for APPS also the
expected value's first element, as APPS stores some outputs wrapped in a list); an
assert test passes when its code runs to the end. Everything model-written runs in
the sandbox. A test reports that it finished, and what a call returned, as JSON
behind a per-run nonce on stdout; the nonce reaches the harness on stdin, which is
closed before the program runs, so a program that exits early (`sys.exit(0)`) has
passed nothing. A call's expected value never enters the sandbox: it is compared here.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import secrets
import zlib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from areal_ray.reward.sandbox import RunResult

FORMATS = ("stdin", "livecodebench", "apps", "humaneval", "mbpp")
ALIASES = {"taco": "apps"}  # TACO publishes APPS' input_output
KEPT = {"livecodebench": ("public_test_cases", "private_test_cases", "metadata"),
        "apps": ("input_output",),
        "humaneval": ("prompt", "test", "entry_point"),
        "mbpp": ("test_list", "test_setup_code", "test_imports")}

# The names LiveCodeBench's and APPS' graders put in scope before a program runs (their
# starter code uses List, their solutions gcd, deque, ... unimported): the standard
# library's common modules, star-imported, with the builtins back on top (math.pow
# must not shadow pow).
PRELUDE = """\
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
from string import *
from builtins import *
import bisect, collections, copy, fractions, functools, heapq, itertools, math, random
import re, string, sys, time
sys.setrecursionlimit(1 << 15)
"""


@dataclass(frozen=True)
class Case:
    """One test. `kind` "stdin": feed `stdin`, compare stdout with `expected` (text);
    "call": call the suite's function with `args`, compare with `expected` (a JSON
    value); "assert": run `test_code` after the program, passing when it ends."""
    kind: str
    stdin: str = ""
    expected: object = None
    args: tuple = ()
    test_code: str = ""


@dataclass(frozen=True)
class Suite:
    source: str  # a FORMATS name
    cases: tuple[Case, ...]
    fn_name: str = ""  # the function (or Solution method) call tests call
    prefix: str = ""  # text run before the program (PRELUDE, HumanEval's prompt)
    compare: str = "lines"  # how stdin tests compare: "lines" or "tokens" (numbers by value)
    first_of_list: bool = False  # APPS: a list output may hold the expected value first
    int_keys: bool = False  # APPS: JSON's string keys of a dict argument back to ints


class _DataOnly(pickle.Unpickler):
    """LiveCodeBench pickles its private tests' JSON text: a pickle that names any
    class or function is refused rather than run."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a pickled test set may hold only data, not {module}.{name}")


def _json(value: object, what: str) -> object:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON ({e})") from None


def _lcb_cases(value: object, what: str) -> list:
    """LiveCodeBench's test list: a JSON text, or (code_generation_lite's private tests)
    that text pickled, zlib-compressed and base64-encoded; or the decoded list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            try:
                raw = zlib.decompress(base64.b64decode(value.encode(), validate=True))
                value = json.loads(_DataOnly(io.BytesIO(raw)).load())
            except (ValueError, TypeError, EOFError, KeyError, IndexError, OverflowError,
                    zlib.error, pickle.UnpicklingError) as e:  # what a malformed one raises
                raise ValueError(f"{what} is neither JSON nor LiveCodeBench's compressed "
                                 f"form ({e})") from None
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of tests, got {type(value).__name__}")
    return value


def _need(tests: dict, key: str, kind: type, fmt: str) -> object:
    value = tests.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"tests of format {fmt!r} need {key!r} ({kind.__name__}), "
                         f"got {value!r:.80}")
    return value


def checked(tests: object) -> object:
    """`tests` as a row's `answer` keeps them, once parsed (a bad row fails where it is
    read): as published, but only the fields that grade (not a dataset's reference
    solution); LiveCodeBench's compressed private tests stay compressed (several
    times smaller) and are decoded where they are graded."""
    if isinstance(tests, str):
        tests = _json(tests, "tests")
    parse(tests)
    if isinstance(tests, dict):
        fmt = ALIASES.get(tests["format"], tests["format"])
        tests = {"format": fmt, **{k: tests[k] for k in KEPT[fmt] if k in tests}}
    return tests


def parse(tests: object) -> Suite:
    """The spec of `tests` in any FORMATS shape (decoded or as published); ValueError
    naming what is wrong."""
    if isinstance(tests, str):
        tests = _json(tests, "tests")
    if isinstance(tests, list):
        return _stdin(tests)
    if not isinstance(tests, dict):
        raise ValueError("tests must be a non-empty list of {'input': str, 'output': str}, or an "
                         f"object whose 'format' is one of {FORMATS[1:]}, got {type(tests).__name__}")
    fmt = ALIASES.get(tests.get("format"), tests.get("format"))
    parsers = {"livecodebench": _livecodebench, "apps": _apps, "humaneval": _humaneval,
               "mbpp": _mbpp}
    if fmt not in parsers:
        raise ValueError(f"tests format {tests.get('format')!r} is not one of "
                         f"{(*FORMATS[1:], *ALIASES)} (stdin tests are a plain list)")
    suite = parsers[fmt](tests)
    if not suite.cases:
        raise ValueError(f"tests of format {fmt!r} hold no test")
    return suite


def _stdin(tests: list) -> Suite:
    if not tests:
        raise ValueError("tests must be a non-empty list of {'input': str, 'output': str}")
    for i, t in enumerate(tests):
        if not (isinstance(t, dict) and isinstance(t.get("input"), str)
                and isinstance(t.get("output"), str)):
            raise ValueError(f"test {i} must be {{'input': str, 'output': str}}, got {t!r:.80}")
    return Suite("stdin", tuple(Case("stdin", t["input"], t["output"]) for t in tests))


def _livecodebench(tests: dict) -> Suite:
    public = _lcb_cases(tests.get("public_test_cases", []), "public_test_cases")
    private = _lcb_cases(tests.get("private_test_cases", []), "private_test_cases")
    meta = _json(tests.get("metadata", {}), "metadata")
    fn_name = meta.get("func_name") if isinstance(meta, dict) else None
    cases = []
    for i, t in enumerate(public + private):
        if not (isinstance(t, dict) and isinstance(t.get("input"), str)
                and isinstance(t.get("output"), str)):
            raise ValueError(f"livecodebench test {i} must have string 'input' and 'output', "
                             f"got {t!r:.80}")
        if t.get("testtype") == "stdin":
            cases.append(Case("stdin", t["input"], t["output"]))
        elif t.get("testtype") == "functional":
            if not isinstance(fn_name, str) or not fn_name:
                raise ValueError("livecodebench functional tests need metadata's 'func_name'")
            # one JSON value per line, one line per argument
            args = tuple(_json(line, f"livecodebench test {i}'s input")
                         for line in t["input"].strip().split("\n"))
            cases.append(Case("call", expected=_json(t["output"], f"livecodebench test {i}'s output"),
                              args=args))
        else:
            raise ValueError(f"livecodebench test {i}: testtype {t.get('testtype')!r} is not "
                             "'stdin' or 'functional'")
    return Suite("livecodebench", tuple(cases), fn_name or "", PRELUDE, "tokens")


def _apps(tests: dict) -> Suite:
    io_ = _json(tests.get("input_output"), "input_output")
    if not isinstance(io_, dict) or not isinstance(io_.get("inputs"), list) \
            or not isinstance(io_.get("outputs"), list):
        raise ValueError("tests of format 'apps' need 'input_output': "
                         "{'inputs': [...], 'outputs': [...], 'fn_name'?: str}")
    ins, outs, fn_name = io_["inputs"], io_["outputs"], io_.get("fn_name")
    if len(ins) != len(outs):
        raise ValueError(f"input_output has {len(ins)} inputs and {len(outs)} outputs")
    if fn_name is not None:
        if not isinstance(fn_name, str) or not fn_name:
            raise ValueError(f"input_output's fn_name must be a function name, got {fn_name!r:.80}")
        for i, args in enumerate(ins):
            if not isinstance(args, list):
                raise ValueError(f"apps call test {i}: inputs must be a list of arguments, "
                                 f"got {args!r:.80}")
        cases = tuple(Case("call", expected=o, args=tuple(a)) for a, o in zip(ins, outs))
        return Suite("apps", cases, fn_name, PRELUDE, first_of_list=True, int_keys=True)
    cases = []
    for i, (inp, out) in enumerate(zip(ins, outs)):
        inp, out = (_lines(v) for v in (inp, out))  # some are lists of lines
        if not (isinstance(inp, str) and isinstance(out, str)):
            raise ValueError(f"apps stdin test {i}: input and output must be text, got "
                             f"{inp!r:.40} / {out!r:.40}")
        cases.append(Case("stdin", inp, out))
    return Suite("apps", tuple(cases), "", PRELUDE, "tokens")


def _lines(value: object) -> object:
    return "\n".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value


def _humaneval(tests: dict) -> Suite:
    test = _need(tests, "test", str, "humaneval")
    entry = _need(tests, "entry_point", str, "humaneval")
    if not entry.isidentifier():
        raise ValueError(f"humaneval entry_point {entry!r} is not a Python name")
    prompt = tests.get("prompt") or ""
    if not isinstance(prompt, str):
        raise ValueError(f"humaneval prompt must be text, got {type(prompt).__name__}")
    # the prompt (imports, signature, docstring, helpers the test may call) then the
    # program, as HumanEval's harness joins prompt and completion
    prefix = prompt if not prompt or prompt.endswith("\n") else prompt + "\n"
    return Suite("humaneval", (Case("assert", test_code=f"{test}\ncheck({entry})\n"),), prefix=prefix)


def _mbpp(tests: dict) -> Suite:
    asserts = _need(tests, "test_list", list, "mbpp")
    setup = tests.get("test_setup_code") or ""
    imports = tests.get("test_imports") or []  # the sanitized split's field
    if not isinstance(setup, str) or not (isinstance(imports, list)
                                          and all(isinstance(s, str) for s in imports)):
        raise ValueError("mbpp test_setup_code must be text and test_imports a list of lines")
    if not all(isinstance(a, str) and a.strip() for a in asserts):
        raise ValueError("mbpp test_list must hold the tests' code (assert statements) as text")
    head = "".join(f"{line}\n" for line in imports) + (f"{setup}\n" if setup else "")
    return Suite("mbpp", tuple(Case("assert", test_code=f"{head}{a}\n") for a in asserts))


# The harness that runs a call or assert test: the program is executed from a string
# (so its `if __name__ == "__main__":` block does not run, as in the benchmarks'
# graders), stdin is closed before it runs (it held the nonce and the arguments), and
# the result goes to file descriptor 1 behind the nonce, whatever the program did to
# sys.stdout.
_HARNESS = '''\
def _harness(program, test_code, fn_name, int_keys):
    import json, os, sys
    nonce = sys.stdin.readline().strip()
    args = json.loads(sys.stdin.read())
    sys.stdin.close()
    sys.stdin = open(os.devnull)
    out = sys.__stdout__  # the program may replace sys.stdout
    space = {"__name__": "solution"}
    exec(compile(program, "solution.py", "exec"), space)
    if test_code is not None:
        exec(compile(test_code, "test.py", "exec"), space)
        result = None
    else:
        if "class Solution" in program and "Solution" in space:  # LeetCode's form
            fn = getattr(space["Solution"](), fn_name, None)
        else:
            fn = space.get(fn_name)
        if fn is None:
            raise SystemExit(f"the program defines no {fn_name!r}")
        if int_keys and args and isinstance(args[0], dict):
            try:
                args = [{int(k): v for k, v in args[0].items()}, *args[1:]]
            except ValueError:
                pass
        result = fn(*args)
        if isinstance(result, tuple):
            result = list(result)
    for stream in (sys.stdout, out):  # what the program printed goes first
        try:
            stream.flush()
        except Exception:
            pass
    data = ("\\n" + nonce + json.dumps(result) + "\\n").encode()
    while data:
        data = data[os.write(1, data):]


_harness(%r, %r, %r, %r)
'''


def script(suite: Suite, case: Case, code: str) -> tuple[str, str, str]:
    """(the program to run, its stdin, the nonce its result comes back behind; "" for a
    stdin test)."""
    program = suite.prefix + code
    if case.kind == "stdin":
        return program, case.stdin, ""
    nonce = secrets.token_hex(16)
    test_code = case.test_code if case.kind == "assert" else None
    return (_HARNESS % (program, test_code, suite.fn_name, suite.int_keys),
            f"{nonce}\n{json.dumps(list(case.args))}", nonce)


def judge(suite: Suite, case: Case, run: RunResult, nonce: str) -> str | None:
    """None when the test passed, else why not."""
    if run.reason != "ok":
        last = (run.stderr.strip().splitlines() or [""])[-1]
        return "assertion failed" if case.kind == "assert" and last.startswith("AssertionError") \
            else run.reason
    stdout = run.stdout
    if case.kind == "stdin":
        same = same_tokens if suite.compare == "tokens" else same_lines
        return None if same(stdout, case.expected) else "wrong answer"
    found = [line[len(nonce):] for line in stdout.splitlines() if line.startswith(nonce)]
    if not found:
        return "no result (the program ended before its test did)"
    if case.kind == "assert":
        return None
    try:
        got = json.loads(found[-1])
    except ValueError:
        return "wrong answer"
    return None if call_matches(got, case.expected, suite.first_of_list) else "wrong answer"


def call_matches(got: object, expected: object, first_of_list: bool = False) -> bool:
    """A call's result (as JSON gives it back: tuples are lists) against the expected
    value; with `first_of_list` (APPS) a non-empty expected list may hold it first."""
    if got == expected:
        return True
    return first_of_list and isinstance(expected, list) and bool(expected) and got == expected[0]


def same_lines(got: str, want: str) -> bool:
    """Line by line, trailing whitespace ignored (our stdin tests)."""
    norm = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def same_tokens(got: str, want: str) -> bool:
    """Line by line, each stripped; a line that differs as text may still hold the same
    numbers (1.0 vs 1.00): LiveCodeBench's comparison, used for APPS' stdin tests too."""
    a, b = ([line.strip() for line in text.strip().split("\n")] for text in (got, want))
    return len(a) == len(b) and all(x == y or _same_numbers(x, y) for x, y in zip(a, b))


def _same_numbers(a: str, b: str) -> bool:
    try:
        x, y = [Decimal(t) for t in a.split()], [Decimal(t) for t in b.split()]
        return bool(x) and x == y
    except InvalidOperation:  # not numbers (or a signalling NaN)
        return False
