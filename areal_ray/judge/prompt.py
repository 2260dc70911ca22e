"""What a served reward reads: a template over the question, the sample's text, its
final answer and the row's reference answer (`reward.judge.template`)."""

from __future__ import annotations

from dataclasses import dataclass

BOXED = "\\boxed{"


def final_answer(text: str) -> str:
    """The content of the last `\\boxed{...}` of `text` (braces balanced), else "": a
    judge reading only the answer reads a short, bounded prompt."""
    start = text.rfind(BOXED)
    if start < 0:
        return ""
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return ""  # unclosed: no answer was given


@dataclass(frozen=True)
class Item:
    """One call to a served reward: the row's question and reference, one sample's text."""
    question: str
    response: str
    reference: str


def render(template: str, item: Item) -> str:
    """The prompt (judge) or scored text (reward model) of `item`. The template was
    checked with the config (config/judge.py: only known fields), so this cannot fail
    on a field; a brace inside the values is text, not a field."""
    return template.format(question=item.question, response=item.response,
                           answer=final_answer(item.response), reference=item.reference)
