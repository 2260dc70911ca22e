"""Several endpoint replicas, each session on one of them, and a restarted replica's
sessions refused rather than silently restarted.

Sessions live in a replica's memory (sessions.py), so every call of a session must
reach the replica that holds it. Serve's model multiplexing (`serve_multiplexed_model_id`
keyed by the session id) looked like the fit but is only a cache hint: in Ray 2.60 the
router sends a request to a replica that holds the "model" only while it answers within
RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S (1-2 s; a busy replica, or one whose
model ids the controller has not yet relayed, loses the request to the replica with the
fewest models), and its LRU evicts models by count, not by bytes or liveness. Either
would split a session across replicas: its calls would be recorded in two places and
the second would re-encode the first's history.

So the endpoint is `replicas` Serve deployments of one replica each (shards), and a
session's shard is a fixed function of its id (`shard_of`: a hash that every process
computes alike; Python's `hash` is salted per process). The ingress, shard 0, forwards a
session's calls to its shard's deployment handle; a deployment with one replica has
nowhere else to send them, so affinity holds whatever Serve's router does. Each shard
bounds its own memory (`max_sessions` of at most `max_session_bytes` each).

A restarted shard holds none of its sessions. Without a record that outlives the
replica, the next call of such a session would open a new one and continue from a
re-encoded history: the trained tokens would no longer be the sampled ones. So each
shard notes the sessions it opens in a `SessionRegistry` (the cluster's GCS key-value
store: it outlives every actor), under the replica's incarnation; a shard that is asked
for a session it does not hold, noted under another incarnation, answers 410 naming the
session, until the session is deleted. The notes of one endpoint build share a prefix,
so a new run never sees an old run's.

Pure: the key-value store is passed in (deployments/openai_api.py gives the GCS's).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from areal_ray.rollout.openai.protocol import APIError


def shard_of(sid: str, n: int) -> int:
    """The shard (0..n-1) that holds session `sid`: the same in every process and run."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    digest = hashlib.blake2b(sid.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n


class KV(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, value: str) -> None: ...

    async def delete(self, key: str) -> None: ...


class SessionLost(APIError):
    """The session was held by a replica that has since restarted: its calls are gone."""

    def __init__(self, sid: str, holder: str):
        super().__init__(410, f"session {sid!r} was lost: the endpoint replica that held it "
                              f"({holder}) restarted, and its recorded calls went with it. "
                              "Continuing it would record a re-encoded history, not the sampled "
                              "tokens: delete it and start a new session")

    def body(self) -> dict:
        body = super().body()
        body["error"]["type"] = "session_lost"
        return body


class SessionRegistry:
    """Which replica incarnation opened each session (`incarnation`: unique per replica
    start; `name`: the replica as the refusal names it), in a store that outlives it."""

    def __init__(self, kv: KV, prefix: str, incarnation: str, name: str):
        self.kv, self.prefix, self.incarnation, self.name = kv, prefix, incarnation, name

    def _key(self, sid: str) -> str:
        return f"{self.prefix}/{sid}"

    def _value(self) -> str:
        return f"{self.incarnation} {self.name}"

    async def check(self, sid: str, opening: bool) -> None:
        """Before a call of `sid`, which this replica does not hold: SessionLost when
        another incarnation opened it; else, when the call opens it (`opening`), note it
        as this incarnation's."""
        got = await self.kv.get(self._key(sid))
        if got is not None:
            incarnation, _, holder = got.partition(" ")
            if incarnation != self.incarnation:
                raise SessionLost(sid, holder)
        if opening and got is None:
            await self.kv.put(self._key(sid), self._value())

    async def release(self, sid: str) -> None:
        """`sid` is no longer held here (deleted, dropped, or never opened: a refused
        first call): forget it, so it is not refused after a restart."""
        await self.kv.delete(self._key(sid))


class MemoryKV:
    """A KV in this process, for tests."""

    def __init__(self):
        self.data: dict[str, str] = {}

    async def get(self, key: str) -> str | None:
        return self.data.get(key)

    async def put(self, key: str, value: str) -> None:
        self.data[key] = value

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)
