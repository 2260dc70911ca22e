"""The reward stage: checkers run by an autoscaling pool of Ray Data actors.

Each actor keeps one worker *process* and runs every check there with a deadline. A
check that overruns (or kills its process) gets reward 0 with a reason, the worker
process is terminated and replaced, and the run goes on: a checker can never stall
or crash training. Nor poison it: a reward that is not a finite number (NaN, inf, not
a number at all) is 0 with the reason, as a checker's exception is (`graded`). The
pool itself is Ray Data's autoscaling actor pool (`ActorPoolStrategy(min_size,
max_size)`), which grows with queued groups and shrinks when idle.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing as mp
import pickle
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from areal_ray.config.reward import RewardConfig
from areal_ray.judge.deadline import REASON_KINDS as SERVED_REASON_KINDS
from areal_ray.reward.registry import CheckerRegistry
from areal_ray.types import Group

logger = logging.getLogger(__name__)
_registries: dict[tuple, CheckerRegistry] = {}  # per checker process, by extra checkers


def check(verifier: str, text: str, answer: str, opts: dict | None = None,
          checkers: dict | None = None) -> tuple[float, str] | float:
    """(reward, reason); runs inside the worker process. The checker is the
    registry's for `verifier`, the built-ins and `checkers` (name -> dotted path);
    each is built once per process, all at its first check (`TimedChecker.warm`).
    For `code`, `answer` is the JSON list of tests."""
    key = tuple(sorted((checkers or {}).items()))
    if key not in _registries:
        _registries[key] = CheckerRegistry(checkers)
        _registries[key].warm()
    return _registries[key].check(verifier, text, answer, opts)


# a served reward's kinds first: "judge timeout" is not a checker's "timeout"
_REASON_KINDS = (*SERVED_REASON_KINDS, "non-finite", "timeout", "died", "checker error", "no fenced code block",
                 "no code", "output limit", "killed", "exit", "wrong answer", "all passed", "checked")


def reason_kind(reason: str) -> str:
    """A low-cardinality category of a reward reason, for per-step histograms."""
    return next((k for k in _REASON_KINDS if k in reason), reason[:40])


def graded(value: object, verifier: str) -> tuple[float, str]:
    """A checker's answer as (reward, reason); a bare reward reads as reason "checked".
    A NaN or infinite reward would turn the group's advantages, the loss and then
    every weight into NaN; so it is 0, with the reason, as is a reward that is not a
    number."""
    reward, reason = value if isinstance(value, tuple) and len(value) == 2 else (value, "checked")
    try:
        r = float(reward)
    except (TypeError, ValueError):
        return 0.0, f"checker error: the {verifier!r} checker's reward {reward!r:.60} is not a number"
    if not math.isfinite(r):
        return 0.0, f"non-finite reward {r} from the {verifier!r} checker ({reason})"
    return r, str(reason)


def serve(fd: int) -> None:
    """The checker process (`python -c`, started by `TimedChecker`): take the parent's
    sys.path, then the check function (by reference: a module-level function or a
    partial of one), then answer checks until the pipe closes."""
    conn = Connection(fd)
    sys.path[:] = conn.recv()
    fn = pickle.loads(conn.recv_bytes())
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(*msg)))
        except Exception as e:  # noqa: BLE001 - reported to the caller as the reason
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))


class TimedChecker:
    """Runs checks in a child process, each bounded by `timeout_s` of wall time.

    A plain process and pipe (not a multiprocessing.Pool): the process can be killed
    outright on a timeout. Started as `python -c` rather than by multiprocessing's
    spawn, which first re-runs the parent's main module in the child: in a Ray worker
    that is Ray's worker script (~0.3 CPU-seconds of imports per checker process, one
    per reward actor and evaluation, every job). The child exits when the pipe closes,
    its parent's end included.
    """

    def __init__(self, timeout_s: float = 5.0, fn=check):
        self.timeout_s = timeout_s
        # a module-level function (or a partial of one): the child imports it by name
        self.fn = fn
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.restarts = 0

    def _ensure(self) -> Connection:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            fn = pickle.dumps(self.fn)  # a function that cannot travel fails here, before a process starts
            self._conn, child = mp.Pipe()
            fd = child.fileno()
            self._proc = subprocess.Popen(
                [sys.executable, "-c", f"from areal_ray.reward.pool import serve; serve({fd})"],
                pass_fds=(fd,))
            child.close()
            self._conn.send(sys.path)
            self._conn.send_bytes(fn)
        return self._conn

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
            self.restarts += 1
        self._proc = self._conn = None

    def __call__(self, verifier: str, text: str, answer: str, opts: dict | None = None,
                 timeout_s: float | None = None) -> tuple[float, str]:
        conn = self._ensure()
        timeout_s = timeout_s or self.timeout_s
        try:
            conn.send((verifier, text, answer, opts))
            if not conn.poll(timeout_s):
                self._kill()
                return 0.0, f"timeout after {timeout_s}s"
            kind, value = conn.recv()
        except (EOFError, OSError) as e:
            self._kill()
            return 0.0, f"checker process died ({type(e).__name__})"
        if kind == "ok":
            return graded(value, verifier)
        return 0.0, f"checker error: {value}"

    def warm(self, timeout_s: float = 60.0) -> None:
        """Start the process and build the checkers now (math-verify's import, and
        any of reward.checkers). Paid by the first real check instead, a process start
        and those imports (seconds on a busy machine) would count against that
        check's deadline."""
        if getattr(self.fn, "func", self.fn) is check:
            self("math", "0", "0", timeout_s=max(timeout_s, self.timeout_s))

    def close(self) -> None:
        self._kill()


class Grader:
    """How a run grades a sample, built from `reward.*` (`from_config`) by the training
    reward stage and held-out evaluation alike, so both grade the same way: the
    verifier registry with `reward.checkers`, run in a `TimedChecker` bounded by
    `reward.timeout_s`; a `code` sample with the sandbox settings (`reward.code_*`,
    `reward.sandbox`) and bounded by `reward.code_timeout_s` instead."""

    def __init__(self, timeout_s: float, code_timeout_s: float, code_opts: dict,
                 checkers: dict | None = None, check_fn=check):
        # `checkers` travel to the checker process with the function.
        fn = functools.partial(check_fn, checkers=dict(checkers)) if checkers else check_fn
        self.checker = TimedChecker(timeout_s, fn=fn)
        self.code_timeout_s, self.code_opts = code_timeout_s, dict(code_opts)

    @classmethod
    def from_config(cls, reward: RewardConfig, check_fn=check) -> Grader:
        """From the run's `reward` section (`RewardConfig`)."""
        return cls(reward.timeout_s, reward.code_timeout_s,
                   {"time_limit_s": reward.code_time_limit_s,
                    "memory_limit_mb": reward.code_memory_limit_mb, "sandbox": reward.sandbox},
                   dict(reward.checkers), check_fn)

    def __call__(self, verifier: str, text: str, answer: str) -> tuple[float, str]:
        if verifier == "code":
            return self.checker(verifier, text, answer, self.code_opts, self.code_timeout_s)
        return self.checker(verifier, text, answer)

    def warm(self) -> None:
        self.checker.warm()

    def close(self) -> None:
        self.checker.close()


class RewardStage:
    """Ray Data UDF: fills in reward and reward_reason of every sample of each group,
    graded as `reward` (the run's `RewardConfig`) says (`Grader`); a group whose
    verifier a served reward grades (`reward.judge`, `reward.reward_model`) is sent to
    its Serve app instead, every sample at once, each call under its deadline
    (areal_ray/judge/client.py): this actor only waits, and at most that long."""

    def __init__(self, reward: RewardConfig | None = None, driver_name: str = "",
                 namespace: str = "", check_fn=check):
        reward = reward or RewardConfig()
        self.grader = Grader.from_config(reward, check_fn)
        self.grader.warm()  # while the run starts up, not in the first step
        from areal_ray.cluster.ownership import tag_of_driver
        from areal_ray.judge.client import from_config as served_rewards
        tag = tag_of_driver(driver_name)
        self.served = served_rewards(reward, tag) if tag else None
        if driver_name:  # counted in the reward-pool size metric while it lives
            import ray
            ctx = ray.get_runtime_context()
            ray.get_actor(driver_name, namespace=namespace).register_reward_actor.remote(
                ctx.get_actor_id(), ctx.current_actor)

    def __del__(self):
        self.grader.close()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        tickets, rows = [], []
        for ticket, blob in zip(batch["ticket"], batch["group"]):
            group = Group.from_row({"ticket": int(ticket), "group": blob})
            t0 = time.perf_counter()
            if self.served is not None and self.served.serves(group.verifier):
                graded_all = self.served.grade(group.verifier, group.prompt, group.answer,
                                               [s.text for s in group.samples])
            else:
                graded_all = (self.grader(group.verifier, s.text, group.answer) for s in group.samples)
            for i, (s, (reward, reason)) in enumerate(zip(group.samples, graded_all)):
                s.reward, s.reward_reason = reward, reason
                if s.reward_reason.startswith("non-finite"):
                    logger.warning("ticket %d sample %d: %s; its reward is 0",
                                   group.ticket, i, s.reward_reason)
            group.meta["reward_s"] = time.perf_counter() - t0
            row = group.to_row()
            tickets.append(row["ticket"])
            rows.append(row["group"])
        return {"ticket": tickets, "group": rows}
