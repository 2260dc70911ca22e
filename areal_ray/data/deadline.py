"""How long one episode may run before the rollout stage abandons it (pure, no Ray).

A fixed deadline has to be generous enough for the slowest run it may meet (an
episode can wait out weight pushes and, with `rollout.release_memory`, whole training
steps), so on a run whose episodes take a second it leaves a stuck one stalling the
cluster for half an hour. The run's own episodes say what is normal for it: once
`warmup` episodes have finished, the deadline is `factor` times the p99 of the
recent ones' durations, never below `floor_s`, and never above `ceiling_s`
(`rollout.episode_timeout_s`, the hard limit, which applies alone during warm-up;
0 turns deadlines off).
Each episode gets the deadline in force when it starts. Abandoned episodes are not
observed: their duration is the deadline, not the episode's.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from areal_ray.observe.utilization import percentile


@dataclass
class EpisodeDeadline:
    ceiling_s: float  # rollout.episode_timeout_s; 0: none
    factor: float = 0.0  # 0: the ceiling alone
    floor_s: float = 0.0
    warmup: int = 0
    window: int = 1000  # recent durations kept
    _recent: deque = field(default_factory=deque, init=False, repr=False)
    _p99: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self._recent = deque(maxlen=max(1, self.window))

    def observe(self, duration_s: float) -> None:
        """An episode finished (not abandoned) after `duration_s`."""
        if math.isfinite(duration_s) and duration_s >= 0:
            self._recent.append(duration_s)
            self._p99 = None

    def p99(self) -> float | None:
        """The recent durations' 99th percentile (nearest rank), or None before any."""
        if not self._recent:
            return None
        if self._p99 is None:
            self._p99 = percentile(list(self._recent), 99)
        return self._p99

    def adaptive(self) -> bool:
        """Whether the run's own durations set the deadline now."""
        return self.factor > 0 and len(self._recent) >= max(1, self.warmup)

    def timeout_s(self) -> float:
        """The deadline of an episode starting now; 0: none (a ceiling of 0 turns
        deadlines off altogether, as it always has)."""
        if self.ceiling_s <= 0 or not self.adaptive():
            return self.ceiling_s
        return min(max(self.floor_s, self.factor * self.p99()), self.ceiling_s)

    def describe(self, timeout_s: float) -> str:
        """Where `timeout_s` came from, for the abandonment's log line."""
        if timeout_s == self.ceiling_s or not self.adaptive():
            return f"rollout.episode_timeout_s={self.ceiling_s:g}"
        return (f"{timeout_s:g} s = max(rollout.episode_deadline_floor_s={self.floor_s:g}, "
                f"rollout.episode_deadline_factor={self.factor:g} x recent p99 {self.p99():.3g} s)")
