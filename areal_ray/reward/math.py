"""Math answer checking on math-verify.

Model output is untrusted: it may be empty, huge, binary, unbalanced LaTeX, or an
expression whose value does not fit in memory. The rules, in order:
  * a `</think>` block ends the reasoning; only the text after the last one is graded;
  * the answer is the content of the *last top-level* `\\boxed{...}` (models box
    drafts); a box inside a box is part of the outer one's content, and a final box
    that never closes (a truncated or malformed answer) means no answer, whatever
    was boxed before it;
  * otherwise a GSM8K-style `#### N` line is the answer;
  * the gold answer may itself be a GSM8K solution (`... #### 72`).
Cost is bounded in this module, not only by the reward pool's killable process: the
response is cut to `MAX_RESPONSE_CHARS`, extraction is one linear scan, and an answer
math-verify would have to evaluate at unbounded cost (longer than
`MAX_ANSWER_CHARS`, a power tower, an exponent or factorial argument over
`MAX_EXPONENT`) scores 0 without being parsed. In a process's main thread (the reward
pool's checker, TRL's reward function) math-verify's own timeouts apply as well;
elsewhere they cannot (they are signal-based).
"""

from __future__ import annotations

import logging
import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

MAX_RESPONSE_CHARS = 20_000
MAX_ANSWER_CHARS = 1_000  # a boxed answer, not a derivation
VERIFY_TIMEOUT_S = 5
MAX_EXPONENT = 10_000  # 9^10000 has 9,543 digits: cheap; 9^(9^9) has 370 million
_BOX = "\\boxed{"
_POWER = re.compile(r"\^|\*\*")
_TOKEN = re.compile(r"\s*(\d+|\\[a-zA-Z]+|.)?", re.S)
_INT = re.compile(r"\d+")
_FACTORIAL = re.compile(r"(\d+)\s*!")
# math-verify warns on every call that its own timeouts are off; we bound time elsewhere.
logging.getLogger("math_verify").setLevel(logging.ERROR)
_GSM8K = re.compile(r"####\s*([^\n]+)")


def last_boxed(text: str) -> str | None:
    """Content of the last top-level `\\boxed{...}`; None when there is none or the last
    one never closes. One pass: every character is looked at once."""
    answer, i, n = None, 0, len(text)
    while (start := text.find(_BOX, i)) != -1:
        depth, k = 1, start + len(_BOX)
        while k < n and depth:
            c = text[k]
            depth += 1 if c == "{" else -1 if c == "}" else 0
            k += 1
        if depth:
            return None  # the final box is unterminated: no answer
        answer, i = text[start + len(_BOX): k - 1], k
    return answer


def _operand_end(expr: str, j: int) -> int:
    """End of the operand starting at `j`: a balanced {...} or (...) group, else one
    token (a number, a command, a character)."""
    close = {"{": "}", "(": ")"}.get(expr[j:j + 1])
    if close is None:
        return _TOKEN.match(expr, j).end()
    depth, k = 0, j
    while k < len(expr):
        depth += 1 if expr[k] == expr[j] else -1 if expr[k] == close else 0
        k += 1
        if depth == 0:
            break
    return k


def costly(expr: str) -> str | None:
    """Why evaluating `expr` could take unbounded time or memory, or None. Linear:
    an exponent holding a power ends the scan."""
    if len(expr) > MAX_ANSWER_CHARS:
        return f"answer longer than {MAX_ANSWER_CHARS} chars"
    for m in _POWER.finditer(expr):
        k = _operand_end(expr, m.end())
        exponent = expr[m.end():k]
        if "^" in exponent or "**" in exponent or _POWER.match(expr[k:].lstrip()):
            return "a power tower"
        if any(int(d) > MAX_EXPONENT for d in _INT.findall(exponent)):
            return f"an exponent over {MAX_EXPONENT}"
    if any(int(d) > MAX_EXPONENT for d in _FACTORIAL.findall(expr)):
        return f"a factorial over {MAX_EXPONENT}"
    return None


def extract_answer(response: str) -> str | None:
    text = response[-MAX_RESPONSE_CHARS:]
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    m = _GSM8K.findall(text)
    return m[-1].strip() if m else None


def _timeout_s() -> int | None:
    """math-verify's signal-based timeouts work only in the main thread."""
    return VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(expr: str):
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    return parse(f"${expr}$", extraction_config=configs, parsing_timeout=_timeout_s())


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals `answer`, else 0.0. Never raises."""
    try:
        if not isinstance(response, str) or not isinstance(answer, str):
            return 0.0
        pred = extract_answer(response)
        if pred is None or not pred.strip():
            return 0.0
        if costly(pred):
            return 0.0
        gold_text = _GSM8K.findall(answer)[-1].strip() if "####" in answer else answer
        gold, got = _parse(gold_text.strip()), _parse(pred.strip())
        if not gold or not got:
            return 0.0
        return 1.0 if verify(gold, got, timeout_seconds=_timeout_s()) else 0.0
    except Exception:  # noqa: BLE001 - any failure of a checker is a wrong answer
        return 0.0


class MathChecker:
    """The built-in `math` verifier (reward/registry.py)."""

    def check(self, text: str, answer: str, opts: dict | None = None) -> tuple[float, str]:
        return math_reward(text, answer), "checked"
