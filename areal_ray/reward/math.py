"""Math answer checking on math-verify.

Model output is untrusted: it may be empty, huge, binary, or unbalanced LaTeX. The
rules, in order:
  * a `</think>` block ends the reasoning; only the text after the last one is graded;
  * the *last* `\\boxed{...}` in that text is the answer (models often box drafts);
  * otherwise a GSM8K-style `#### N` line is the answer;
  * the gold answer may itself be a GSM8K solution (`... #### 72`).
math-verify does the parsing and the equivalence check. Its own signal-based timeouts
are disabled because they only work in a process's main thread (not in Ray actors);
the reward pool bounds time by running checks in a killable subprocess, and the
response is cut to `MAX_RESPONSE_CHARS` first so parsing stays cheap.
"""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

MAX_RESPONSE_CHARS = 20_000
# math-verify warns on every call that its own timeouts are off; we bound time elsewhere.
logging.getLogger("math_verify").setLevel(logging.ERROR)
_GSM8K = re.compile(r"####\s*([^\n]+)")


def last_boxed(text: str) -> str | None:
    """Content of the last balanced `\\boxed{...}`, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i, depth = start + len("\\boxed{"), 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{"): i - 1]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
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


def _parse(expr: str):
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    return parse(f"${expr}$", extraction_config=configs, parsing_timeout=None)


def math_reward(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals `answer`, else 0.0. Never raises."""
    try:
        if not isinstance(response, str) or not isinstance(answer, str):
            return 0.0
        pred = extract_answer(response)
        if pred is None or not pred.strip():
            return 0.0
        gold_text = _GSM8K.findall(answer)[-1].strip() if "####" in answer else answer
        gold, got = _parse(gold_text.strip()), _parse(pred.strip())
        if not gold or not got:
            return 0.0
        return 1.0 if verify(gold, got, timeout_seconds=None) else 0.0
    except Exception:  # noqa: BLE001 - any failure of a checker is a wrong answer
        return 0.0
