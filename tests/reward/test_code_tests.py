"""Call-based and assert-style code tests (code_tests.py): each published format read
into one spec, graded in the sandbox as its own benchmark grades it; the rows are ours
(code_rows.py), in the published shapes. The programs run under bubblewrap where it is
installed, else in the explicit rlimits mode (tests/conftest.py: available_sandbox)."""

import ast
import base64
import json
import pickle
import re
import zlib
from pathlib import Path

import pytest

from areal_ray.data.prompts import check_row
from areal_ray.reward.code import CodeChecker, run_tests
from areal_ray.reward.code_tests import (
    Case,
    Suite,
    call_matches,
    checked,
    judge,
    parse,
    same_lines,
    same_tokens,
    script,
)
from areal_ray.reward.sandbox import RunResult
from tests.reward.code_rows import ROWS, lcb_compressed, lcb_functional

REPO = Path(__file__).resolve().parents[2]


def by_uid(uid):
    return next(r for r in ROWS if r["uid"] == uid)


# ---- reading the formats (no code runs) ----

@pytest.mark.parametrize("uid, source, kinds, fn_name", [
    ("lcb-functional-solution", "livecodebench", ["call"] * 3, "maxPairSum"),
    ("lcb-functional-function", "livecodebench", ["call"] * 2, "summary"),
    ("lcb-stdin", "livecodebench", ["stdin"] * 3, ""),
    ("apps-call", "apps", ["call"] * 3, "even_key_sum"),
    ("taco-call-solution", "apps", ["call"] * 2, "runningSum"),
    ("apps-stdin", "apps", ["stdin"] * 2, ""),
    ("humaneval-own", "humaneval", ["assert"], ""),
    ("mbpp-setup", "mbpp", ["assert"] * 3, ""),
    ("mbpp-sanitized-float", "mbpp", ["assert"] * 2, ""),
])
def test_each_format_is_read_into_one_spec(uid, source, kinds, fn_name):
    suite = parse(by_uid(uid)["tests"])
    assert (suite.source, [c.kind for c in suite.cases], suite.fn_name) == (source, kinds, fn_name)
    # what a row's answer holds reads back to the same spec
    assert parse(json.loads(json.dumps(checked(by_uid(uid)["tests"])))) == suite


def test_the_published_encodings_are_read():
    lcb = parse(by_uid("lcb-functional-solution")["tests"])
    # one JSON value per line, one line per argument; the private tests decompressed
    assert [(c.args, c.expected) for c in lcb.cases] == [(([1, 5, 3], 2), 8), (([4], 1), 4),
                                                         (([-1, -2, 7, 7], 3), 13)]
    apps = parse(by_uid("apps-stdin")["tests"])
    assert [(c.stdin, c.expected) for c in apps.cases] == [("3\n", "3\n9\n"), ("10\n", "10\n100")]
    mbpp = parse(by_uid("mbpp-setup")["tests"])
    assert mbpp.cases[0].test_code == "data = [1, 2, 2, 3, 2]\nassert count_of(data, 2) == 3\n"
    assert parse(by_uid("mbpp-sanitized-float")["tests"]).cases[1].test_code.startswith("import math\n")
    he = parse(by_uid("humaneval-own")["tests"])
    assert he.prefix.startswith("from typing import List") and he.cases[0].test_code.endswith("check(doubled)\n")
    # the rest of a dataset's row is not carried on in the answer
    he = checked({**by_uid("humaneval-own")["tests"], "canonical_solution": "    return []\n",
                 "task_id": "HumanEval/0"})
    assert sorted(he) == ["entry_point", "format", "prompt", "test"]
    # a parquet column may hold the tests as JSON text
    assert parse(json.dumps(by_uid("apps-call")["tests"])) == parse(by_uid("apps-call")["tests"])
    assert parse([{"input": "1\n", "output": "1\n"}]).cases == (Case("stdin", "1\n", "1\n"),)


class Boom:
    def __reduce__(self):
        return (print, ("ran",))


def test_the_documented_rows_are_read_as_documented():
    """docs/data.md's example row of each format is a row of that format."""
    doc = (REPO / "docs/data.md").read_text()
    section = doc[doc.index("## Code tasks"):doc.index("## Order of use")]
    rows = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]
    suites = [parse(check_row(r, "docs")["answer"]) for r in rows]
    assert [s.source for s in suites] == ["stdin", "livecodebench", "apps", "humaneval", "mbpp"]
    assert [s.fn_name for s in suites][1:3] == ["maxPairSum", "even_key_sum"]


def test_a_compressed_test_set_that_names_code_is_refused(capsys):
    evil = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    tests = {"format": "livecodebench", "public_test_cases": "[]", "private_test_cases": evil,
             "metadata": "{}"}
    with pytest.raises(ValueError, match="may hold only data, not builtins.print"):
        parse(tests)
    assert "ran" not in capsys.readouterr().out
    good = lcb_compressed([lcb_functional("1", "1")])
    assert pickle.loads(zlib.decompress(base64.b64decode(good))).startswith("[")  # the fixture's form


@pytest.mark.parametrize("tests, message", [
    ([], "non-empty list"),
    (7, "non-empty list.*got int"),
    ({"format": "codeforces"}, "format 'codeforces' is not one of"),
    ({"input_output": "{}"}, "format None is not one of"),
    ({"format": "apps", "input_output": "{not json"}, "input_output is not valid JSON"),
    ({"format": "apps", "input_output": {"inputs": [[1]], "outputs": []}}, "1 inputs and 0 outputs"),
    ({"format": "apps", "input_output": {"fn_name": "f", "inputs": [1], "outputs": [1]}},
     "inputs must be a list of arguments"),
    ({"format": "apps", "input_output": {"inputs": [], "outputs": []}}, "hold no test"),
    ({"format": "livecodebench", "public_test_cases": [lcb_functional("1", "1")], "metadata": {}},
     "need metadata's 'func_name'"),
    ({"format": "livecodebench", "public_test_cases": [{"input": "1", "output": "1", "testtype": "x"}],
      "metadata": {}}, "testtype 'x'"),
    ({"format": "livecodebench", "public_test_cases": "@@", "metadata": {}}, "neither JSON nor"),
    ({"format": "humaneval", "test": "def check(c): pass"}, "need 'entry_point'"),
    ({"format": "humaneval", "test": "", "entry_point": "a b"}, "not a Python name"),
    ({"format": "mbpp", "test_list": "assert f()"}, "need 'test_list' \\(list\\)"),
    ({"format": "mbpp", "test_list": ["assert f()"], "test_imports": "import math"}, "test_imports"),
])
def test_bad_tests_are_named(tests, message):
    with pytest.raises(ValueError, match=message):
        checked(tests)


def test_a_bad_row_fails_where_it_is_loaded():
    with pytest.raises(Exception, match=r"data\.jsonl:3: tests format 'lcb'"):
        check_row({"prompt": "p", "verifier": "code", "tests": {"format": "lcb"}}, "data.jsonl:3")


@pytest.mark.parametrize("got, expected, first_of_list, same", [
    (3, 3, False, True),
    ([1, 2], [1, 2], False, True),     # a tuple result reaches here as a list
    (3, [3], False, False),            # LiveCodeBench: no unwrapping
    (3, [3], True, True),              # APPS: the expected value wrapped in a list
    ([3], [[3]], True, True),
    (2.5, 2.5, False, True),
    (0.30000000000000004, 0.3, False, False),  # floats compare exactly, as the graders do
    (True, 1, False, True),            # Python's equality, as in the graders
    ("3", 3, True, False),
    (None, [], True, False),
])
def test_call_results(got, expected, first_of_list, same):
    assert call_matches(got, expected, first_of_list) is same


@pytest.mark.parametrize("got, want, lines, tokens", [
    ("3\n9\n", "3\n9", True, True),
    ("3  \n9", "3\n9\n\n", True, True),
    ("3\n  9", "3\n9", False, True),   # leading space: only the stripped comparison
    ("0.5\n", "0.50\n", False, True),  # numbers by value
    ("1e2", "100", False, True),
    ("0.333333", "0.3333333", False, False),
    ("3 9", "3\n9", False, False),
    ("abc", "abd", False, False),
    ("", "", True, True),
    ("sNaN", "sNaN", True, True),
    ("sNaN", "1", False, False),
])
def test_stdout_comparisons(got, want, lines, tokens):
    assert (same_lines(got, want), same_tokens(got, want)) == (lines, tokens)


def test_the_harness_holds_neither_the_expected_value_nor_the_nonce():
    suite = parse(by_uid("apps-call")["tests"])
    case = suite.cases[0]
    program, stdin, nonce = script(suite, case, "def even_key_sum(d):\n    return 7\n")
    ast.parse(program)
    assert nonce not in program and "even_key_sum" in program
    assert stdin.startswith(nonce + "\n") and json.loads(stdin.split("\n", 1)[1]) == [{"1": 5, "2": 7}]
    again = script(suite, case, "x")
    assert again[2] != nonce  # a fresh nonce per run


@pytest.mark.parametrize("kind, stdout, stderr, reason, why", [
    ("call", "{n}7\n", "", "ok", None),
    ("call", "7\n", "", "ok", "no result (the program ended before its test did)"),
    ("call", "noise\n{n}[7]\n", "", "ok", None),
    ("call", "{n}8\n", "", "ok", "wrong answer"),
    ("call", "", "Traceback\nZeroDivisionError: x", "exit 1", "exit 1"),
    ("assert", "{n}null\n", "", "ok", None),
    ("assert", "", "Traceback\nAssertionError", "exit 1", "assertion failed"),
    ("assert", "", "", "timeout", "timeout"),
])
def test_judge(kind, stdout, stderr, reason, why):
    suite = Suite("apps", (), "f", first_of_list=True)
    case = Case(kind, expected=[7])
    run = RunResult(0 if reason == "ok" else 1, stdout.format(n="N0NCE"), stderr, reason)
    assert judge(suite, case, run, "N0NCE") == why


# ---- graded in the sandbox ----

@pytest.mark.usefixtures("available_sandbox")
@pytest.mark.parametrize("uid", [r["uid"] for r in ROWS])
def test_each_format_passes_right_programs_and_fails_wrong_ones(uid):
    row = by_uid(uid)
    n = len(parse(row["tests"]).cases)
    # the limits are the sandbox's; 30 s of wall time only so a loaded machine's slow
    # starts are not read as timeouts (the wrong programs all end at once)
    for code in row["right"]:
        res = run_tests(code, row["tests"], time_limit_s=30.0)
        assert (res.reward, res.passed, res.total) == (1.0, n, n), (code, res)
    for code in row["wrong"]:
        res = run_tests(code, row["tests"], time_limit_s=30.0)
        assert res.reward == 0.0 and res.passed < n and "timeout" not in res.reason, (code, res)


@pytest.mark.usefixtures("available_sandbox")
def test_a_loaded_row_is_graded_by_the_code_checker():
    """From the row to the reward as a run sees it: check_row checks the tests and
    stores them in `answer`, and the built-in checker grades a fenced answer against
    them."""
    published = by_uid("lcb-functional-solution")
    row = check_row({**published, "tests": {**published["tests"], "question_id": "1"}}, "rows.jsonl:1")
    # as published (the private tests still compressed), without the rest of the row
    assert json.loads(row["answer"]) == published["tests"]
    text = f"Sure.\n```python\n{by_uid('lcb-functional-solution')['right'][0]}```\n"
    assert CodeChecker().check(text, row["answer"], {"time_limit_s": 30.0})[0] == 1.0


@pytest.mark.usefixtures("available_sandbox")
def test_a_call_that_runs_forever_is_a_timeout_and_ends_the_check():
    tests = parse(by_uid("apps-call")["tests"])
    res = run_tests("def even_key_sum(d):\n    while True: pass\n", by_uid("apps-call")["tests"],
                    time_limit_s=1.0)
    assert (res.reward, res.passed, res.total) == (0.0, 0, len(tests.cases))
    assert res.reason.startswith("test 0: timeout")


@pytest.mark.usefixtures("available_sandbox")
def test_printing_during_a_call_does_not_confuse_the_result():
    code = ("import sys\ndef even_key_sum(d):\n    print('debug', d)\n    sys.stdout = None\n"
            "    return sum(v for k, v in d.items() if k % 2 == 0)\n")
    assert run_tests(code, by_uid("apps-call")["tests"], time_limit_s=30.0).reward == 1.0

