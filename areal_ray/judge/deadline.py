"""A served reward call's deadline and what each ending of a call is worth.

A call's deadline runs from its send (`reward.<kind>.timeout_s`); a call that fails
(its replica died, the app is gone) is sent again while its deadline leaves time, at
most `retries` times: Serve routes the new one to a live replica. A call still
unanswered at its deadline is reward 0, reason "<kind> timeout", and so is one that
failed for good, reason "<kind> failed". The reasons' first words are the kinds the
step record counts (`reward_reasons`, reward/pool.py `reason_kind`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("judge", "reward_model")
# reason_kind's categories of a served reward's reasons, most specific first
REASON_KINDS = tuple(f"{k} {what}" for k in KINDS
                     for what in ("timeout", "failed", "unparsed", "non-finite", "scored"))


@dataclass
class CallDeadline:
    """One call: sent at `start` (monotonic seconds), answered by `start + timeout_s`."""
    timeout_s: float
    retries: int
    start: float
    attempts: int = 1

    def left(self, now: float) -> float:
        return max(self.start + self.timeout_s - now, 0.0)

    def retry(self, now: float) -> bool:
        """After a failed attempt: whether to send it again (and count the attempt)."""
        if self.attempts > self.retries or self.left(now) <= 0:
            return False
        self.attempts += 1
        return True


def late(kind: str, timeout_s: float) -> tuple[float, str]:
    return 0.0, f"{kind} timeout after {timeout_s:g}s"


def failed(kind: str, error: BaseException, attempts: int) -> tuple[float, str]:
    return 0.0, f"{kind} failed after {attempts} attempt(s): {type(error).__name__}: {error}"[:300]


def answered(kind: str, value: object) -> tuple[float, str]:
    """A replica's (reward, reason) as the reward: a NaN, infinite or non-number reward
    would poison the group's advantages, so it is 0 with the reason."""
    reward, reason = value if isinstance(value, (tuple, list)) and len(value) == 2 else (value, "")
    try:
        r = float(reward)
    except (TypeError, ValueError):
        return 0.0, f"{kind} non-finite: reward {reward!r:.60} is not a number"
    if not math.isfinite(r):
        return 0.0, f"{kind} non-finite: reward {r}"
    return r, str(reason) or f"{kind} scored {r:.3g}"
