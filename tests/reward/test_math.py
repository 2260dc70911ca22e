import time

import pytest

from areal_ray.reward.math import costly, extract_answer, last_boxed, math_reward


@pytest.mark.parametrize("response,answer,expected", [
    ("12+7=19.\\boxed{19}", "19", 1.0),
    ("draft \\boxed{3}, final \\boxed{19}", "19", 1.0),   # last boxed wins
    ("\\boxed{19} then \\boxed{3}", "19", 0.0),
    ("<think>\\boxed{2}</think> so \\boxed{1}", "1", 1.0),  # graded after </think>
    ("<think>\\boxed{1}</think> no answer", "1", 0.0),
    ("so the total is\n#### 72", "Natalia sold ... #### 72", 1.0),  # GSM8K both sides
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),                 # math-verify equivalence
    ("\\boxed{20}", "2", 0.0),
    ("", "1", 0.0),
    ("\x00\xff{{{\\boxed{", "1", 0.0),                     # garbage, unbalanced
    ("\\boxed{1" + "}" * 5, "1", 1.0),                      # stray closers after the box
    ("\\boxed{\\boxed{42}}", "42", 1.0),                  # a nested box is the outer's content
    ("\\boxed{7} then \\boxed{\\boxed{\\boxed{42}", "42", 0.0),  # unterminated final box: no answer
    ("\\boxed{7} then \\boxed{8", "7", 0.0),
    ("x" * 1_000_000 + "\\boxed{7}", "7", 1.0),            # huge output is cut, not parsed whole
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_never_raises_on_non_strings():
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_reward("\\boxed{1}", 1) == 0.0  # type: ignore[arg-type]


def test_extraction_helpers():
    assert last_boxed("a \\boxed{x{y}} b \\boxed{w}") == "w"
    assert last_boxed("a \\boxed{x{y}} b \\boxed{z") is None
    assert extract_answer("no answer here") is None


# Hostile outputs, each with a bound far above what it takes now and below what it took
# before (seconds to minutes; only the reward pool's process deadline contained them).
@pytest.mark.parametrize("response, bound_s", [
    ("\\boxed{" * 2_900, 1.0),                       # 20 KB of openers: was ~5 s (quadratic)
    ("\\boxed{" * 2_900 + "}" * 2_900, 1.0),
    ("\\boxed{3}" * 2_000, 2.0),
    ("\\boxed{9^{9^{9^{9}}}}", 1.0),                 # was > 60 s inside math-verify
    ("\\boxed{9**9**9}", 1.0),
    ("\\boxed{9^(9^9)}", 1.0),
    ("\\boxed{2^{99999999}}", 1.0),
    ("\\boxed{99999999!}", 1.0),
    ("\\boxed{" + "1+" * 5_000 + "1}", 1.0),           # longer than any answer
])
def test_hostile_outputs_are_graded_zero_within_a_bound(response, bound_s):
    t0 = time.thread_time()  # this thread's CPU, not wall: the bound is on the work, not the load
    assert math_reward(response, "1") == 0.0
    assert time.thread_time() - t0 < bound_s


@pytest.mark.parametrize("expr, reason", [
    ("9^{9^{9}}", "a power tower"), ("9^9^9", "a power tower"), ("9^(9^9)", "a power tower"),
    ("2^{100000}", "an exponent over 10000"), ("20000!", "a factorial over 10000"),
    ("2^{100}", None), ("x^2+1", None), ("(2^3)^4", None), ("\\frac{1}{2}", None), ("12!", None),
])
def test_costly_names_what_it_refuses(expr, reason):
    assert costly(expr) == reason


def test_answers_within_the_bounds_are_still_checked():
    assert math_reward("\\boxed{2^{10}}", "1024") == 1.0
    assert math_reward("\\boxed{5!}", "120") == 1.0
