"""Reward checkers by verifier name: a row's `verifier` picks the checker of its samples.

A checker is a class with `check(text, answer, opts) -> (reward, reason)` (a bare
reward reads as reason "checked"), built without arguments. `math`, `code` and
`chain` (the embedded long-chain task's strict final-answer grade, task/chains.py) are
built in; `reward.checkers` (name -> dotted path) adds names, or replaces a built-in
one. Checkers are imported and built where they run, in the reward actor's checker
process (`pool.py`), on first use and once per process: math-verify's import costs
seconds, a user's checker may cost more, and the processes that only relay rows
(the driver, Ray Data's coordinator) never pay for it. `check_checkers` imports the
extra ones once before Ray starts, so a bad path fails the job naming its key.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from areal_ray.config.judge import JUDGE, REWARD_MODEL
from areal_ray.plugins import PluginError, import_class

KEY = "reward.checkers"
BUILTIN = {"math": "areal_ray.reward.math.MathChecker",
           "code": "areal_ray.reward.code.CodeChecker",
           "chain": "areal_ray.task.chains.ChainChecker"}  # the long-chain task's strict grade
SERVED = (JUDGE, REWARD_MODEL)  # graded by a Serve app in training (areal_ray/judge/), never here


@runtime_checkable
class RewardChecker(Protocol):
    def check(self, text: str, answer: str, opts: dict) -> tuple[float, str] | float:
        """Grade one sample's decoded `text` against the row's `answer`; `opts` are
        the verifier's settings (for `code`: time and memory limits), often empty."""


class CheckerRegistry:
    """Verifier name -> checker, the built-ins overlaid by `extra` (name -> path)."""

    def __init__(self, extra: dict[str, str] | None = None):
        self.paths = {**BUILTIN, **check_names(extra or {})}
        self._checkers: dict[str, RewardChecker] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.paths))

    def get(self, verifier: str) -> RewardChecker:
        if verifier not in self._checkers:
            if verifier in SERVED and verifier not in self.paths:
                raise ValueError(f"verifier {verifier!r} is a served model's (reward.{verifier}): rows "
                                 "naming it are graded in training by its Serve app with "
                                 f"reward.{verifier}.enabled=true; no checker grades them here (held-out "
                                 "evaluation needs rows with a checker's verifier, e.g. math)")
            if verifier not in self.paths:
                raise ValueError(f"unknown verifier {verifier!r}: the checkers are "
                                 f"{', '.join(self.names)} (add one under {KEY})")
            key = f"{KEY}.{verifier}" if verifier not in BUILTIN else f"verifier {verifier!r}"
            self._checkers[verifier] = import_class(self.paths[verifier], key, "check")()
        return self._checkers[verifier]

    def warm(self) -> None:
        """Build every checker now, so that their imports are paid at the checker
        process's start (`TimedChecker.warm`) and not within a check's deadline. One
        that fails here fails again, with its message, when a row uses it."""
        for name in self.paths:
            try:
                self.get(name)
            except Exception:  # noqa: BLE001 - reported by the check that uses it
                pass

    def check(self, verifier: str, text: str, answer: str,
              opts: dict | None = None) -> tuple[float, str] | float:
        return self.get(verifier).check(text, answer, opts or {})


def check_names(extra: object) -> dict[str, str]:
    """`extra` as a name -> path mapping, or `PluginError` naming the entry."""
    if not isinstance(extra, dict):
        raise PluginError(f"{KEY} must be a mapping of verifier name -> dotted class path, "
                          f"got {type(extra).__name__}")
    for name, path in extra.items():
        if not isinstance(name, str) or not name.strip():
            raise PluginError(f"{KEY}: verifier name {name!r} must be a non-empty string")
        if not isinstance(path, str):
            raise PluginError(f"{KEY}.{name}: {path!r} is not a dotted class path")
    return dict(extra)


def check_checkers(extra: object) -> tuple[str, ...]:
    """Import every extra checker and check it has `check`; the verifier names then
    known, or `PluginError` naming the entry."""
    for name, path in check_names(extra).items():
        import_class(path, f"{KEY}.{name}", "check")
    return verifier_names(extra)


def verifier_names(extra: dict | None = None) -> tuple[str, ...]:
    """Every verifier a row may name: the built-ins and the extra ones."""
    return tuple(sorted({*BUILTIN, *check_names(extra or {})}))
