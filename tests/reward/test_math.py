import pytest

from areal_ray.reward.math import extract_answer, last_boxed, math_reward


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
    ("\\boxed{1" + "}" * 5, "1", 1.0),
    ("x" * 1_000_000 + "\\boxed{7}", "7", 1.0),            # huge output is cut, not parsed whole
])
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_never_raises_on_non_strings():
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert math_reward("\\boxed{1}", 1) == 0.0  # type: ignore[arg-type]


def test_extraction_helpers():
    assert last_boxed("a \\boxed{x{y}} b \\boxed{z") == "x{y}"
    assert extract_answer("no answer here") is None
