"""Ctrl-C during training: stop at the end of the step, with a checkpoint; SIGTERM: stop
at once, through the job's cleanup.

The first SIGINT asks the driver to stop the trainer after its current step (it then
saves a checkpoint when `train.checkpoint_every` is on, so `run.resume=true` continues
from exactly there); the job then exits with status 130 and one line. A second Ctrl-C
stops at once (Python's KeyboardInterrupt), as Ray's own processes ignore SIGINT and
are cleaned up when the job exits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class RunInterrupted(KeyboardInterrupt):
    """The run stopped because it was asked to; the message says where it stopped."""


class Terminated(KeyboardInterrupt):
    """SIGTERM: `ray job stop`, or a scheduler ending the job."""


def raise_on_sigterm() -> None:
    """SIGTERM raises `Terminated` in the main thread, so the job's `finally` blocks run
    (its MLflow run ends FAILED, its Serve app is deleted) in the seconds `ray job stop`
    waits before SIGKILL; Python's default would end the process with none of them.
    Outside the main thread it does nothing, as StopOnInterrupt."""
    def handle(signum, frame):
        raise Terminated("stopped by SIGTERM (ray job stop)")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handle)


class StopOnInterrupt:
    """Context manager around `trainer.fit()`: the first SIGINT calls `request_stop()`
    and restores the previous handler. Outside the main thread (a notebook runs the job
    in a worker thread) signals cannot be handled there, and it does nothing."""

    def __init__(self, request_stop, notice=print):
        self.request_stop, self.notice = request_stop, notice
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)
        self.notice("[areal-ray] interrupted: stopping after this step "
                    "(Ctrl-C again to stop at once)")
        self.request_stop()

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None and not self.requested:
            signal.signal(signal.SIGINT, self._previous)


class WorkerThread:
    """`fn()` started at once in a worker thread; `result()` waits for it in short
    joins, so the waiting thread's signal handlers run. For `trainer.fit()`: in the
    main thread it installs Ray Train's own SIGINT handler, which aborts the run at
    once, without a checkpoint. Started early, the job does other work (the eval
    before) while the trainer starts."""

    def __init__(self, fn: Callable[[], T], name: str = "fit"):
        self._out: dict = {}
        self._thread = threading.Thread(target=self._target, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _target(self, fn) -> None:
        try:
            self._out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            self._out["error"] = e

    def join(self, timeout_s: float) -> bool:
        """Whether it ended within `timeout_s`."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self) -> T:
        while self._thread.is_alive():
            self._thread.join(0.2)
        if "error" in self._out:
            raise self._out["error"]
        return self._out.get("value")


def in_worker_thread(fn: Callable[[], T]) -> T:
    """`fn()` in a worker thread while this one waits (WorkerThread)."""
    return WorkerThread(fn).result()
