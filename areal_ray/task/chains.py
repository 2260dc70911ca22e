"""The embedded reasoning-shaped task: long arithmetic chains, worked step by step.

The same chains as the quickstart's task (arith.py: `12+7-3+5=`, worked as
`12+7=19,19-3=16,16+5=21.\\boxed{21}`, running totals in [0, 99]), but the number of
steps is drawn from a discretised log-normal, capped at `max_steps`: most problems
take a few steps, a tenth take over twenty, a few take fifty. A worked step is about
8 characters (tokens, for the char-level tokenizer), so a worked answer is ~20 tokens
for one step and ~400 for fifty: outputs spread over more than an order of magnitude,
long-tailed like a reasoning model's. That is the regime the asynchronous design is
for (issue 33): a synchronous trainer waits for the longest sample of every batch
while the finished rows idle; continuous batching, interruptible generation and
staleness-bounded overlap hide that wait. The quickstart's chains (at most 8 steps,
~35-token answers) have no such tail.

The grade (`grade`, the `chain` verifier: reward/registry.py) reads only the final
answer, but strictly: the whole output must be either a bare `\\boxed{N}` or worked
steps `a+d=s,...` then `.\\boxed{N}`, nothing before or after, N a plain integer. A
truncated answer (no closing box), a second box, prose or stray characters score 0,
so a policy cannot be rewarded for output that only happens to contain the number.
The steps themselves are not checked: a wrong step that ends at the right total is
still right, as a human grader of the final answer would score it.

Everything is generated from a seed: nothing is downloaded.
"""

from __future__ import annotations

import math
import random
import re

from areal_ray.task.arith import ArithProblem, make_chain

VERIFIER = "chain"
MEDIAN_STEPS = 5      # the log-normal's median (a problem has 1 + its floor steps: median 5 or 6)
SIGMA = 1.25          # its spread in log space: p90 is about 5 * e^(1.28 * 1.25) = 25 steps
MAX_STEPS = 48        # the cap: a worked answer of ~400 tokens
MAX_OUTPUT_CHARS = 4_000  # beyond any well-formed answer at MAX_STEPS; longer is not read

_STEP = r"\d{1,2}[+-]\d=\d{1,2}"
_OUTPUT = re.compile(rf"(?:{_STEP}(?:,{_STEP})*\.)?\\boxed\{{(\d{{1,3}})\}}")


def draw_steps(rng: random.Random, median: float = MEDIAN_STEPS, sigma: float = SIGMA,
               max_steps: int = MAX_STEPS) -> int:
    """1 + floor of a log-normal draw with the given median, capped at max_steps."""
    return min(max_steps, 1 + int(math.exp(rng.gauss(math.log(median), sigma))))


def make_problem(rng: random.Random, median: float = MEDIAN_STEPS, sigma: float = SIGMA,
                 max_steps: int = MAX_STEPS, p_direct: float = 0.0, p_quit: float = 0.0) -> ArithProblem:
    """One chain of `draw_steps` steps; a bare boxed answer with probability p_direct,
    else, with probability p_quit, a solution that quits early (`quit_early`)."""
    p = make_chain(rng, draw_steps(rng, median, sigma, max_steps), p_direct)
    if p_quit and rng.random() < p_quit:
        p = quit_early(p, rng)
    return p


def quit_early(p: ArithProblem, rng: random.Random) -> ArithProblem:
    """The worked solution cut after k < n_steps steps (k uniform), boxing the running
    total there: the lazy reasoner of the warm start's second phase, which stops
    working before the chain ends and is wrong for it. A one-step chain, or a bare
    answer, is left whole."""
    head = p.solution.split(".\\boxed")[0]
    steps = head.split(",")
    if p.n_steps < 2 or len(steps) != p.n_steps:
        return p
    k = rng.randint(1, p.n_steps - 1)
    total = steps[k - 1].split("=")[1]
    return ArithProblem(prompt=p.prompt, solution=",".join(steps[:k]) + ".\\boxed{" + total + "}",
                        answer=p.answer, n_steps=p.n_steps)


def make_split(seed: int, n: int, median: float = MEDIAN_STEPS, sigma: float = SIGMA,
               max_steps: int = MAX_STEPS, p_direct: float = 0.0,
               p_quit: float = 0.0) -> list[ArithProblem]:
    check_params(median, sigma, max_steps)
    rng = random.Random(seed)
    return [make_problem(rng, median, sigma, max_steps, p_direct, p_quit) for _ in range(n)]


def check_params(median: float, sigma: float, max_steps: int) -> None:
    if not median >= 1:
        raise ValueError(f"chain median steps must be >= 1, got {median}")
    if not sigma >= 0:
        raise ValueError(f"chain sigma must be >= 0, got {sigma}")
    if not max_steps >= 1:
        raise ValueError(f"chain max_steps must be >= 1, got {max_steps}")


def to_row(problem: ArithProblem, uid: str) -> dict:
    """A prompt row graded by the `chain` verifier."""
    return {**problem.to_row(uid), "verifier": VERIFIER}


def grade(text: object, answer: object) -> float:
    """1.0 if `text` is a well-formed answer (module docstring) whose boxed integer
    equals `answer`, else 0.0. Never raises."""
    if not isinstance(text, str) or not isinstance(answer, str) or len(text) > MAX_OUTPUT_CHARS:
        return 0.0
    m = _OUTPUT.fullmatch(text.strip())
    return 1.0 if m is not None and m.group(1) == answer.strip() else 0.0


class ChainChecker:
    """The built-in `chain` verifier (reward/registry.py): `grade` with a reason."""

    def check(self, text: str, answer: str, opts: dict | None = None) -> tuple[float, str]:
        if isinstance(text, str) and _OUTPUT.fullmatch(text.strip()) is None:
            return 0.0, "malformed"
        return grade(text, answer), "checked"
