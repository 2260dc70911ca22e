"""The engine client: what a rollout workflow calls to generate, over the rollout Serve app.

Token ids in and out: the app owns the tokenizer (`encode`, `decode_batch`), so a
workflow, and the Ray Data actor it runs in, needs neither transformers nor torch.
The client outlives the replica it talks to: when Serve loses a replica under a call
(`RayActorError`), the same call goes again, to a live one, backing off; a rollout
app that stays gone fails the run. For a generation round the samples keep every
token of their earlier rounds and redo only that round's, as after a weight push.

Requests cross to the replica as `GenerationRequest`s (rollout/engines/base.py), the
type the replica admits and the router reads the budget of, never as positional
arguments. A workflow sees only this class's methods, never the handle, so the next clients (an
OpenAI-compatible endpoint, a local engine in tests) can stand in for it.
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayActorError

from areal_ray.rollout.engines.base import GenerationRequest

logger = logging.getLogger(__name__)
# ~1 min in all, backing off up to 10 s: Serve starts a replacement replica in seconds.
REPLICA_RETRIES = 8
# The rollout app's `graceful_shutdown_wait_loop_s`: a stopping replica sleeps this long
# before it first counts its ongoing requests (Serve's default 2 s, there for routers
# to drop it first; a handle's router hears of it by long poll within milliseconds,
# and a call that still reaches a stopped replica goes again, above). A job's end
# waits one such sleep for its app, as does every replica autoscaling retires.
DRAIN_POLL_S = 0.25


class EngineClient:
    """Calls to the rollout app through a Serve deployment handle (anything whose
    `handle.<method>.remote(*args)` is awaitable)."""

    def __init__(self, handle, retries: int = REPLICA_RETRIES, backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0):
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries ({retries}) and backoff_s ({backoff_s}) must be >= 0")
        self.handle, self.retries = handle, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s

    @classmethod
    def for_app(cls, app_name: str, deployment_name: str, **kwargs) -> EngineClient:
        from ray import serve
        return cls(serve.get_deployment_handle(deployment_name, app_name=app_name), **kwargs)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt + 1`."""
        return min(self.backoff_s * 2 ** attempt, self.max_backoff_s)

    async def call(self, method: str, *args):
        """`method` of the app, retried on a lost replica (up to `retries` times)."""
        for attempt in range(self.retries + 1):
            try:
                return await getattr(self.handle, method).remote(*args)
            except RayActorError as e:
                if attempt == self.retries:
                    raise
                logger.warning("rollout replica lost during %s (%s); retrying on a live one",
                               method, type(e).__name__)
                await asyncio.sleep(self.backoff(attempt))

    async def generate(self, input_ids: list[int], max_new_tokens: int,
                       temperature: float, stop_ids: list[int] | None = None,
                       seed: int | None = None) -> dict:
        """One request: `{output_ids, logprobs, versions, stop_reason}`; stop reason
        "abort" when a weight push interrupted it (resubmit what is left), "stop" at
        EOS or at one of `stop_ids` (kept as the last output token). `seed`: the
        request's sampling seed (rollout/seeds.py)."""
        return await self.call("generate", GenerationRequest(
            input_ids, max_new_tokens, temperature, stop_ids=list(stop_ids or ()), seed=seed))

    async def generate_batch(self, input_ids: list[list[int]], max_new_tokens: list[int],
                             temperature: float, stop_ids: list[int] | None = None,
                             seeds: list[int | None] | None = None) -> list[dict]:
        """Several requests in one Serve call (one result each, in order): cheaper for
        the caller than one call per request. They travel as `GenerationRequest`s."""
        seeds = [None] * len(input_ids) if seeds is None else list(seeds)
        if not len(input_ids) == len(max_new_tokens) == len(seeds):
            raise ValueError(f"generate_batch: {len(input_ids)} prompts but "
                             f"{len(max_new_tokens)} max_new_tokens and {len(seeds)} seeds")
        stops = list(stop_ids or ())
        return await self.call("generate_batch", [
            GenerationRequest(ids, n, temperature, stop_ids=stops, seed=seed)
            for ids, n, seed in zip(input_ids, max_new_tokens, seeds)])

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text` as generation sees them (no special tokens added)."""
        return await self.call("encode", text)

    async def decode_batch(self, ids: list[list[int]]) -> list[str]:
        """Texts of outputs, special tokens skipped (what rewards read)."""
        return await self.call("decode_batch", ids)
