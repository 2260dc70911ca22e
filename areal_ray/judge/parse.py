"""The judge's text to a reward in [0, 1] with its reason, or 0 with the reason it
could not be read (`reward.judge.parser`)."""

from __future__ import annotations

import math
import re

from areal_ray.judge.prompt import final_answer

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES = ("yes", "correct", "pass", "true", "right")
_NO = ("no", "incorrect", "wrong", "fail", "false")
_WORD = re.compile(r"[a-z]+")


def parse_score(text: str, score_max: float) -> tuple[float, str]:
    """The judge's score: a `\\boxed{}` number if there is one, else the last number of
    the text, over `score_max`, clipped to [0, 1]."""
    boxed = final_answer(text)
    found = _NUMBER.findall(boxed) or _NUMBER.findall(text)
    if not found:
        return 0.0, f"judge unparsed: no score in {text[:60]!r}"
    score = float(found[-1])
    if not math.isfinite(score):
        return 0.0, f"judge unparsed: score {found[-1]!r}"
    return min(max(score / score_max, 0.0), 1.0), f"judge scored {found[-1]}"


def parse_verdict(text: str) -> tuple[float, str]:
    """1 for a yes-word, 0 for a no-word: the first such word of the text decides
    ("incorrect" is a no-word of its own, not "correct" after "in")."""
    for word in _WORD.findall(text.lower()):
        if word in _YES:
            return 1.0, f"judge scored {word}"
        if word in _NO:
            return 0.0, f"judge scored {word}"
    return 0.0, f"judge unparsed: no verdict in {text[:60]!r}"


def parse(text: str, parser: str, score_max: float = 1.0) -> tuple[float, str]:
    if parser == "score":
        return parse_score(text, score_max)
    if parser == "verdict":
        return parse_verdict(text)
    raise ValueError(f"judge parser {parser!r} is not one of ('score', 'verdict')")
