"""Our own small code rows, one or more per published test format (code_tests.py),
shaped field for field as LiveCodeBench, APPS/TACO, HumanEval and MBPP publish theirs
(the problems are ours). Each row carries `right`, programs that must pass every test,
and `wrong`, programs that must fail at least one: kept in the row, ignored by the
loader."""

import base64
import json
import pickle
import zlib


def lcb_compressed(tests: list[dict]) -> str:
    """code_generation_lite's encoding of private tests: their JSON text pickled,
    zlib-compressed, base64-encoded."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def lcb_functional(inp: str, out: str) -> dict:
    return {"input": inp, "output": out, "testtype": "functional"}


def lcb_stdin(inp: str, out: str) -> dict:
    return {"input": inp, "output": out, "testtype": "stdin"}


PAIR_SUM = '''\
class Solution:
    def maxPairSum(self, nums: List[int], k: int) -> int:
        best = sorted(nums, reverse=True)[:k]
        return sum(best)
'''

ROWS = [
    # LiveCodeBench, LeetCode style: a method of class Solution; List comes from the
    # grader's imports; the private tests in code_generation_lite's compressed form.
    {"uid": "lcb-functional-solution", "verifier": "code",
     "prompt": "Return the sum of the k largest numbers.",
     "tests": {"format": "livecodebench",
               "public_test_cases": json.dumps([lcb_functional("[1, 5, 3]\n2", "8")]),
               "private_test_cases": lcb_compressed([lcb_functional("[4]\n1", "4"),
                                                     lcb_functional("[-1, -2, 7, 7]\n3", "13")]),
               "metadata": json.dumps({"func_name": "maxPairSum"})},
     "right": [PAIR_SUM],
     "wrong": [PAIR_SUM.replace("[:k]", "[:k - 1]"),
               PAIR_SUM.replace("maxPairSum", "max_pair_sum")]},  # not the method the tests call
    # LiveCodeBench functional as a plain function: a float result, and a tuple that
    # counts as the expected list.
    {"uid": "lcb-functional-function", "verifier": "code", "prompt": "Mean and extremes.",
     "tests": {"format": "livecodebench",
               "public_test_cases": json.dumps([lcb_functional("[1, 2, 3, 4]", "[2.5, 1, 4]"),
                                                lcb_functional("[5]", "[5.0, 5, 5]")]),
               "private_test_cases": json.dumps([]),
               "metadata": json.dumps({"func_name": "summary"})},
     "right": ["def summary(xs):\n    return (sum(xs) / len(xs), min(xs), max(xs))\n"],
     "wrong": ["def summary(xs):\n    return [sum(xs) // len(xs), min(xs), max(xs)]\n",
               "def summary(xs):\n    return {sum(xs) / len(xs), min(xs), max(xs)}\n"]},  # a set: not JSON
    # LiveCodeBench stdin (AtCoder style): the expected 0.50 matches a printed 0.5 by value.
    {"uid": "lcb-stdin", "verifier": "code", "prompt": "Print a/b.",
     "tests": {"format": "livecodebench",
               "public_test_cases": json.dumps([lcb_stdin("1 2\n", "0.50\n"), lcb_stdin("6 3\n", "2\n")]),
               "private_test_cases": json.dumps([lcb_stdin("7 4\n", "1.75\n")]),
               "metadata": json.dumps({})},
     "right": ["a, b = map(int, input().split())\nq = a / b\nprint(int(q) if q == int(q) else q)\n"],
     "wrong": ["a, b = map(int, input().split())\nprint(round(a / b, 1))\n"]},
    # APPS (Codewars style): fn_name, arguments as lists, some outputs wrapped in a list;
    # a dict argument's keys come back as ints.
    {"uid": "apps-call", "verifier": "code", "prompt": "Sum the values whose key is even.",
     "tests": {"format": "apps",
               "input_output": json.dumps({"fn_name": "even_key_sum",
                                           "inputs": [[{"1": 5, "2": 7}], [{"4": 1, "6": 2, "7": 9}], [{}]],
                                           "outputs": [[7], 3, [0]]})},
     "right": ["def even_key_sum(d):\n    return sum(v for k, v in d.items() if k % 2 == 0)\n"],
     "wrong": ["def even_key_sum(d):\n    return sum(d.values())\n",
               # equal to everything: compared outside the sandbox, as JSON, it is not
               "class Any:\n    def __eq__(self, other):\n        return True\n"
               "def even_key_sum(d):\n    return Any()\n"]},
    # TACO (LeetCode style in APPS' format): class Solution, a list result.
    {"uid": "taco-call-solution", "verifier": "code", "prompt": "Return the running sums.",
     "tests": {"format": "taco",
               "input_output": json.dumps({"fn_name": "runningSum",
                                           "inputs": [[[1, 2, 3]], [[5]]],
                                           "outputs": [[1, 3, 6], [5]]})},
     "right": ["class Solution:\n    def runningSum(self, nums):\n"
               "        return list(accumulate(nums))\n"],  # accumulate from the grader's imports
     "wrong": ["class Solution:\n    def runningSum(self, nums):\n        return nums\n"]},
    # APPS stdin: input/output text, one output given as a list of lines.
    {"uid": "apps-stdin", "verifier": "code", "prompt": "Print n and n squared, one per line.",
     "tests": {"format": "apps",
               "input_output": json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["3\n9\n", ["10", "100"]]})},
     "right": ["n = int(input())\nprint(n)\nprint(n * n)\n"],
     "wrong": ["n = int(input())\nprint(n, n * n)\n"]},
    # HumanEval: the prompt holds an import and a helper the check calls; the right
    # answers are a completion (the body only) and a whole function.
    {"uid": "humaneval-own", "verifier": "code", "prompt": "Complete the function.",
     "tests": {"format": "humaneval",
               "prompt": "from typing import List\n\n\ndef _double(x: int) -> int:\n    return 2 * x\n\n\n"
                         "def doubled(xs: List[int]) -> List[int]:\n"
                         "    \"\"\"Every element doubled.\n    >>> doubled([1, 2])\n    [2, 4]\n    \"\"\"\n",
               "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n"
                       "    assert candidate([]) == []\n    assert candidate([1, -3]) == [_double(1), -6]\n",
               "entry_point": "doubled"},
     "right": ["    return [_double(x) for x in xs]\n",
               "def doubled(xs: List[int]) -> List[int]:\n    return [x * 2 for x in xs]\n"],
     "wrong": ["    return xs\n",
               "    import sys\n    sys.exit(0)\n",  # ends before the check: no pass
               "import os\nos._exit(0)\n"]},
    # MBPP (the full split): test_setup_code defines what the asserts use.
    {"uid": "mbpp-setup", "verifier": "code", "prompt": "Write a function to count a value in a list.",
     "tests": {"format": "mbpp", "test_setup_code": "data = [1, 2, 2, 3, 2]",
               "test_list": ["assert count_of(data, 2) == 3", "assert count_of(data, 9) == 0",
                             "assert count_of([], 1) == 0"],
               "challenge_test_list": []},
     "right": ["def count_of(xs, v):\n    return sum(1 for x in xs if x == v)\n"],
     "wrong": ["def count_of(xs, v):\n    return xs.count(v) or 1\n"]},
    # MBPP (the sanitized split): test_imports, a float result checked with isclose.
    {"uid": "mbpp-sanitized-float", "verifier": "code", "prompt": "Write a function for a circle's area.",
     "tests": {"format": "mbpp", "test_imports": ["import math"],
               "test_list": ["assert math.isclose(area(1), 3.141592653589793)",
                             "assert math.isclose(area(2.5), 19.634954084936208)"]},
     "right": ["import math\ndef area(r):\n    return math.pi * r * r\n"],
     "wrong": ["def area(r):\n    return 3.14 * r * r\n"]},
]
