"""The long-chain task: its length distribution, its rows and its strict grade."""

import random
import statistics

import pytest

from areal_ray.reward.registry import CheckerRegistry
from areal_ray.task import chains
from areal_ray.task.arith import make_chain
from areal_ray.task.tokenizer import ALPHABET, build_char_tokenizer


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_worked_answers_span_an_order_of_magnitude_with_a_long_tail():
    split = chains.make_split(seed=1_000, n=5_000)
    # one token a character (the char tokenizer), plus EOS
    lengths = [len(p.solution) + 1 for p in split]
    p10, p50, p90 = (_percentile(lengths, q) for q in (0.1, 0.5, 0.9))
    # measured: p10 19, p50 51, p90 218, max 395 tokens (mean 90)
    assert 15 <= p10 <= 25 and 40 <= p50 <= 65 and 180 <= p90 <= 260
    assert 350 <= max(lengths) <= 8 * chains.MAX_STEPS + 16
    assert max(lengths) / p10 > 10  # an order of magnitude
    assert statistics.mean(lengths) > 1.5 * p50  # long-tailed: the mean well above the median
    steps = [p.n_steps for p in split]
    assert min(steps) == 1 and max(steps) == chains.MAX_STEPS


def test_the_distribution_follows_its_parameters_and_the_seed():
    short = [p.n_steps for p in chains.make_split(3, 2_000, median=2, sigma=0.5, max_steps=10)]
    assert max(short) <= 10 and statistics.median(short) <= 3
    assert {p.n_steps for p in chains.make_split(3, 50, median=4.5, sigma=0)} == {5}  # 1 + floor(4.5)
    assert chains.make_split(5, 20) == chains.make_split(5, 20) != chains.make_split(6, 20)
    for bad, match in [({"median": 0.5}, "median"), ({"sigma": -1}, "sigma"), ({"max_steps": 0}, "max_steps")]:
        with pytest.raises(ValueError, match=match):
            chains.make_split(0, 1, **bad)


def test_solutions_are_true_arithmetic_and_grade_as_right():
    for p in chains.make_split(seed=7, n=300):
        steps = p.solution.split(".\\boxed")[0].split(",")
        assert len(steps) == p.n_steps
        for step in steps:
            lhs, rhs = step.split("=")
            assert eval(lhs) == int(rhs) and 0 <= int(rhs) <= 99  # noqa: S307 - digits and +/- only
        assert eval(p.prompt.rstrip("=")) == int(p.answer)  # noqa: S307
        assert chains.grade(p.solution, p.answer) == 1.0


def test_the_chains_are_the_quickstarts_chains_at_their_own_lengths():
    # the step count is the chain task's own, the rest is arith.make_chain: the warm
    # start begins from the quickstart's model, which knows this format
    p = chains.make_problem(random.Random(4))
    rng = random.Random(4)
    assert p == make_chain(rng, chains.draw_steps(rng))
    # every character is one token of the char tokenizer: length in tokens = in characters
    tok = build_char_tokenizer()
    for q in chains.make_split(9, 20):
        assert set(q.prompt + q.solution) <= set(ALPHABET)
        assert len(tok(q.solution, add_special_tokens=False)["input_ids"]) == len(q.solution)


def test_rows_name_the_chain_verifier():
    p = chains.make_split(0, 1)[0]
    row = chains.to_row(p, "u")
    assert row == {"uid": "u", "prompt": p.prompt, "answer": p.answer, "verifier": "chain",
                   "n_steps": p.n_steps}


@pytest.mark.parametrize("text,answer,reward", [
    ("12+7=19,19-3=16.\\boxed{16}", "16", 1.0),
    ("\\boxed{16}", "16", 1.0),                          # a bare answer is well formed
    ("12+7=19,19-3=15.\\boxed{16}", "16", 1.0),          # only the final answer is graded
    ("12+7=19,19-3=16.\\boxed{16}\n", "16", 1.0),        # trailing whitespace
    ("12+7=19,19-3=16.\\boxed{17}", "16", 0.0),          # wrong
    ("12+7=19,19-3=16.\\boxed{16", "16", 0.0),           # truncated
    ("12+7=19,19-3=16.", "16", 0.0),                     # no answer
    ("\\boxed{16}\\boxed{16}", "16", 0.0),               # two boxes
    ("the answer is \\boxed{16}", "16", 0.0),            # prose
    ("12+7=19,19-3=16\\boxed{16}", "16", 0.0),           # no full stop before the box
    ("12+7=19,,19-3=16.\\boxed{16}", "16", 0.0),         # empty step
    ("\\boxed{16.0}", "16", 0.0),                        # not a plain integer
    ("\\boxed{016}", "16", 0.0),
    ("\\boxed{-16}", "16", 0.0),
    ("\\boxed{}", "", 0.0),
    ("", "16", 0.0),
    ("\x00\xff\\boxed{16}", "16", 0.0),                  # garbage
    ("1+1=2," * 1_000 + ".\\boxed{16}", "16", 0.0),      # over MAX_OUTPUT_CHARS
    (None, "16", 0.0),
    ("\\boxed{16}", None, 0.0),
])
def test_the_grade_reads_only_a_well_formed_final_answer(text, answer, reward):
    assert chains.grade(text, answer) == reward


def test_the_chain_verifier_is_built_in_and_says_why():
    reg = CheckerRegistry()
    assert reg.check("chain", "\\boxed{16}", "16") == (1.0, "checked")
    assert reg.check("chain", "\\boxed{15}", "16") == (0.0, "checked")
    assert reg.check("chain", "so \\boxed{16}", "16") == (0.0, "malformed")


def test_quitting_early_cuts_the_work_and_boxes_the_running_total():
    rng = random.Random(0)
    for p in chains.make_split(seed=11, n=200):
        q = chains.quit_early(p, rng)
        assert (q.prompt, q.answer, q.n_steps) == (p.prompt, p.answer, p.n_steps)
        if p.n_steps == 1:
            assert q == p  # nothing to quit
            continue
        steps = q.solution.split(".\\boxed")[0].split(",")
        assert 1 <= len(steps) < p.n_steps and p.solution.startswith(q.solution.split(".\\boxed")[0])
        assert q.solution.endswith("\\boxed{" + steps[-1].split("=")[1] + "}")
    # the running total is wrong unless the chain happens to return to it
    lazy = chains.make_split(seed=12, n=500, p_quit=1.0)
    assert sum(chains.grade(p.solution, p.answer) for p in lazy if p.n_steps > 1) < 0.15 * len(lazy)
    assert chains.make_split(seed=12, n=50, p_quit=0.0) == chains.make_split(seed=12, n=50)
