"""A reward checker: `LastLineChecker` gives 1 when the output's last non-empty line is
the answer, 0 otherwise, and says why.

A checker is a class built without arguments with `check(text, answer, opts) ->
(reward, reason)` (areal_ray/reward/registry.py). To use it, no library file changes;
the config names it and the dataset's rows name the verifier:
    reward.checkers={last_line: examples.extending.my_reward.LastLineChecker}
    {"uid": "0", "prompt": "2+2=", "answer": "4", "verifier": "last_line"}
"""

from __future__ import annotations


class LastLineChecker:
    def check(self, text: str, answer: str, opts: dict) -> tuple[float, str]:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            return 0.0, "empty"
        return (1.0, "match") if lines[-1] == answer.strip() else (0.0, "mismatch")
