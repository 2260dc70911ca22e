"""AdmissionGate: exact per-token versions for an engine that runs requests out of our sight.

Engines such as vLLM and sglang batch requests inside their own scheduler (often in
another process), so we cannot swap weights "between two decode steps" as HFEngine
does. Instead every request passes this gate on its way in, and weights change only
while the gate is closed and no request of ours is inside the engine. A request
records the version when it passes the gate, and a result never mixes versions.

Why our own gate rather than the engine's pause API: both vLLM's and sglang's pause
calls act on *their* queue, so a request that passed our gate but has not reached the
engine's scheduler yet can be held across the update and then run on the new weights
under the old version tag. Closing the gate first and draining our own running set
leaves no such window.

Who opens the gate again after a swap: the gate remembers whether its *caller* holds
it closed (`hold`/`release`, the protocol's pause/resume). A swap reopens it unless the
caller holds it. A failed load keeps it closed (the engine's weights may be half
written) and records why in `failed`, which the replica's health check reports, so
Serve replaces a replica that cannot load; the next successful load reopens it. (The
first version decided from "was the gate open when the swap began", so after one
failed load every later swap found it closed and never reopened: the replica stayed
paused for good.)

A swap in `FINISH` mode (an adapter push on an engine that serves several adapters at
once) closes the gate only around the load, and neither aborts nor waits for the
running requests: they go on under the adapter and the version they were admitted
with, and requests admitted after it get the new ones. Closing the gate still matters:
the load switches the adapter new requests get, and the version must switch with it,
with no admission in between.

Pure asyncio: the engine supplies how to abort its running requests and how to load
weights; unit tests drive the gate with no engine at all.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from areal_ray.rollout.engines.base import FINISH, InferenceEngine, check_pause_mode

# abort(request_ids): end these requests now; each returns its partial output.
AbortFn = Callable[[list[str]], Awaitable[None]]


class AdmissionGate:
    def __init__(self, version: int = 0, abort_retry_s: float = 0.5):
        self.version = version
        # An abort that overtakes a request still on its way into the engine is ignored
        # there, and that request would run to its end: re-send while draining.
        self.abort_retry_s = abort_retry_s
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()  # set while no request of ours is inside the engine
        self._idle.set()
        self._update_lock = asyncio.Lock()
        self._running: dict[str, int] = {}  # engine request id -> token budget
        self._queued: dict[object, int] = {}  # ticket -> token budget, waiting at the gate
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._held = False  # the caller paused (hold) and has not resumed (release)
        self.failed: str | None = None  # why the last load failed; None after a good one

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @asynccontextmanager
    async def admitted(self, budget: int, tag: str = "") -> AsyncIterator[tuple[str, int]]:
        """Wait at the gate, then yield (request id, version) while the request runs.

        The id starts with a fresh uuid (engines may abort by prefix, so no id is a
        prefix of another) and ends with `tag`, the caller's id, for the engine's logs.
        """
        ticket = object()
        self._queued[ticket] = budget
        try:
            while not self._open.is_set():  # re-check: a pause may close it again first
                await self._open.wait()
        finally:
            del self._queued[ticket]
        # No await from here to the yield: the version recorded is the one the weights
        # have, and a pause() that starts now sees this request in its drain.
        rid = f"{uuid.uuid4().hex}:{tag}"
        if not self._running:
            self._busy_since = time.perf_counter()
        self._running[rid] = budget
        self._idle.clear()
        try:
            yield rid, self.version
        finally:
            del self._running[rid]
            if not self._running:
                self._busy_s += time.perf_counter() - (self._busy_since or time.perf_counter())
                self._busy_since = None
                self._idle.set()

    async def pause(self, mode: str, abort: AbortFn) -> None:
        """Close the gate; abort the running requests ("abort") or let them finish
        ("wait"); return once none of ours is inside the engine."""
        check_pause_mode(mode)
        self._open.clear()
        while self._running:
            if mode == "abort":
                await abort(list(self._running))
            try:
                await asyncio.wait_for(self._idle.wait(),
                                       self.abort_retry_s if mode == "abort" else None)
            except TimeoutError:
                pass

    def resume(self) -> None:
        self._open.set()

    async def hold(self, mode: str, abort: AbortFn) -> None:
        """The caller's pause: like `pause`, and swaps keep the gate closed until `release`."""
        self._held = True
        await self.pause(mode, abort)

    def release(self) -> None:
        """The caller's resume: opens the gate (also after a failed load: the caller's call)."""
        self._held = False
        self.resume()

    async def swap(self, version: int, mode: str, load: Callable[[], Awaitable[object]],
                   abort: AbortFn) -> dict:
        """pause(mode), await `load()`, serve `version`, reopen unless the caller holds the gate.
        `FINISH`: close the gate for the load alone; running requests go on (see above).

        A failed load (or one cancelled half way) leaves the gate closed and sets `failed`.
        """
        async with self._update_lock:
            t0 = time.perf_counter()
            if mode == FINISH:
                self._open.clear()
            else:
                await self.pause(mode, abort)
            t_paused = time.perf_counter()
            try:
                await load()
            except BaseException as e:
                self.fail(f"loading v{version}", e)
                raise
            self.failed = None
            self.version = version
            if not self._held:
                self.resume()
            return {"pause_s": t_paused - t0, "load_s": time.perf_counter() - t_paused,
                    "version": version}

    def fail(self, what: str, error: BaseException) -> None:
        """Record that `what` failed, as a failed swap does for its load: also for an
        engine left closed by an error outside a swap (weights undefined, memory in an
        unknown state), so the health check reports it and Serve replaces the replica."""
        self.failed = f"{what} failed: {type(error).__name__}: {error}"[:500]

    def busy_s(self) -> float:
        """Seconds during which at least one request of ours was inside the engine."""
        now = time.perf_counter()
        return self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def load(self) -> dict:
        # Non-streaming requests report nothing until they end, so a running request's
        # whole budget counts as outstanding: an upper bound.
        return {"queued": len(self._queued), "running": len(self._running),
                "outstanding_tokens": sum(self._queued.values()) + sum(self._running.values())}


class GatedEngine(InferenceEngine):
    """The protocol's pause/resume/version calls of an engine that keeps an
    `AdmissionGate` in `self.gate` and can abort requests by id (`_abort`)."""

    gate: AdmissionGate

    async def _abort(self, rids: list[str]) -> None:
        raise NotImplementedError

    @property
    def version(self) -> int:
        return self.gate.version

    @version.setter
    def version(self, version: int) -> None:
        """Relabel the weights served (a publication without new weights)."""
        self.gate.version = version

    def get_version(self) -> int:
        return self.gate.version

    async def pause(self, mode: str = "abort") -> None:
        """Close the gate; abort the running requests ("abort") or let them finish
        ("wait"); return once none of ours is inside the engine."""
        await self.gate.hold(mode, self._abort)

    async def resume(self) -> None:
        self.gate.release()

    def load_failure(self) -> str | None:
        """Why the last weight load failed (the gate stays closed), or None."""
        return self.gate.failed

    async def _swap(self, version: int, mode: str, load) -> dict:
        """pause(mode), await `load()`, serve `version`; a failed load keeps the gate closed
        until the next good one (`load_failure` says why)."""
        return await self.gate.swap(version, mode, load, self._abort)
