"""The embedded verifiable task: chains of small additions and subtractions.

A problem is a left-to-right chain such as `12+7-3+5=`; the worked solution writes one
step per line-fragment and ends with the answer in `\\boxed{}`:

    12+7=19,19-3=16,16+5=21.\\boxed{21}

The warm-start data also holds *direct* solutions, a bare `\\boxed{21}` with no work
shown. A tiny model cannot add a chain in its head, so direct answers are mostly
wrong beyond one step, and a model warm-started on the mix often answers directly:
its accuracy is modest. RL then has something real to learn: that working the
problem out pays. It is the effect RL exploits in large reasoning models (longer,
worked reasoning is rewarded), small enough to see on a CPU in minutes.

Chain lengths follow a geometric tail (most chains are short, a few are long), so
output lengths have the long tail under which synchronous RL idles. Running totals
stay in [0, 99] so every token is a digit, an operator or punctuation, which a tiny
character-level model can learn on a CPU in minutes. Everything is generated from a
seed: nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

PROMPT_SUFFIX = "="


@dataclass(frozen=True)
class ArithProblem:
    prompt: str
    solution: str
    answer: str
    n_steps: int

    @property
    def segments(self) -> tuple[tuple[str, bool], ...]:
        """The solution as warm-start segments (text, written by the model): all of it."""
        return ((self.solution, True),)

    def to_row(self, uid: str) -> dict:
        return {"uid": uid, "prompt": self.prompt, "answer": self.answer,
                "verifier": "math", "n_steps": self.n_steps}


def make_problem(rng: random.Random, max_steps: int = 8, p_stop: float = 0.35,
                 p_direct: float = 0.0) -> ArithProblem:
    """One problem; the number of steps is 1 + Geometric(p_stop), capped at max_steps.

    With probability p_direct the solution is the bare boxed answer (no work shown).
    """
    n_steps = 1
    while n_steps < max_steps and rng.random() > p_stop:
        n_steps += 1
    return make_chain(rng, n_steps, p_direct)


def make_chain(rng: random.Random, n_steps: int, p_direct: float = 0.0) -> ArithProblem:
    """A chain of exactly `n_steps` steps (the draws after the step count: the chain
    task, areal_ray/task/chains.py, picks its own count and shares the rest)."""
    total = rng.randint(0, 99)
    expr = str(total)
    parts = []
    for _ in range(n_steps):
        d = rng.randint(1, 9)
        if total + d > 99 or (total - d >= 0 and rng.random() < 0.5):
            op, new = "-", total - d
        else:
            op, new = "+", total + d
        parts.append(f"{total}{op}{d}={new}")
        expr += f"{op}{d}"
        total = new
    boxed = "\\boxed{" + str(total) + "}"
    solution = boxed if rng.random() < p_direct else ",".join(parts) + "." + boxed
    return ArithProblem(prompt=expr + PROMPT_SUFFIX, solution=solution, answer=str(total),
                        n_steps=n_steps)


def make_split(seed: int, n: int, max_steps: int = 8, p_stop: float = 0.35,
               p_direct: float = 0.0) -> list[ArithProblem]:
    rng = random.Random(seed)
    return [make_problem(rng, max_steps, p_stop, p_direct) for _ in range(n)]


def write_jsonl(problems: list[ArithProblem], path: str | Path, prefix: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i, p in enumerate(problems):
            f.write(json.dumps(p.to_row(f"{prefix}-{i}")) + "\n")
