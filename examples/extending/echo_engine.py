"""An inference engine: `EchoEngine` repeats the prompt's tokens back, one per step.

It needs no model, so it shows the whole `InferenceEngine` contract
(areal_ray/rollout/engines/base.py) and nothing else: every output token has a
behaviour logprob (0.0: the echo is certain) and the version of the weights that
produced it; `pause("abort")` ends running requests now with their partial output
(stop reason "abort", which the client resubmits), `pause("wait")` lets them finish;
`update_weights` pauses, loads, serves the new version and resumes.

To use it: one line in areal_ray/rollout/engines/registry.py's ENGINES,
    "echo": "examples.extending.echo_engine:EchoEngine",
then `rollout.backend=echo`.
"""

from __future__ import annotations

import asyncio

from areal_ray.rollout.engines.base import (
    EngineOptions,
    GenerationRequest,
    GenerationResult,
    InferenceEngine,
    check_pause_mode,
)
from areal_ray.rollout.engines.limits import RequestLimits


class EchoEngine(InferenceEngine):
    def __init__(self, model_path: str, max_batch_size: int = 64):
        self.model_path = model_path
        self.version = 0
        self.limits = RequestLimits(vocab_size=None, max_context=None)  # no model: unknown
        self.weights: dict = {}
        self._open = asyncio.Event()
        self._open.set()
        self._abort = False
        self._running = 0
        self._idle = asyncio.Condition()

    @classmethod
    def from_options(cls, model_path: str, opts: EngineOptions) -> EchoEngine:
        return cls(model_path, opts.max_batch_size)

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        await self._open.wait()  # admission: closed while paused
        self._running += 1
        out, versions, reason = [], [], "length"
        try:
            for i in range(req.max_new_tokens):
                if self._abort:
                    reason = "abort"
                    break
                out.append(req.input_ids[i % len(req.input_ids)])
                versions.append(self.version)
                if out[-1] in req.stop_ids:
                    reason = "stop"
                    break
                await asyncio.sleep(0)  # one decode step: others (and a pause) may run
        finally:
            async with self._idle:
                self._running -= 1
                self._idle.notify_all()
        return GenerationResult(out, [0.0] * len(out), versions, reason, rid=req.rid)

    async def pause(self, mode: str = "abort") -> None:
        self._open.clear()
        self._abort = check_pause_mode(mode) == "abort"
        async with self._idle:
            await self._idle.wait_for(lambda: self._running == 0)
        self._abort = False

    async def resume(self) -> None:
        self._open.set()

    async def update_weights(self, state_dict: dict, version: int, mode: str = "abort") -> dict:
        await self.pause(mode)
        self.weights = dict(state_dict)
        self.version = version
        await self.resume()
        return {"tensors": len(state_dict)}

    def load(self) -> dict:
        return {"queued": 0, "running": self._running, "outstanding_tokens": 0}
