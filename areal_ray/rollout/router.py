"""Least-outstanding-tokens routing for the rollout Serve app.

Serve's default router (power of two choices) compares two random replicas by their
count of ongoing requests. In RL rollout requests differ by 10-100x in cost (a long
chain-of-thought next to a two-token answer, or a resubmitted tail of a few tokens),
so equal request counts can hide very unequal work. This router ranks every replica
by the generation budget (`max_new_tokens` of the `GenerationRequest`s the engine
client sends) of the requests it has sent there and that have not completed, and
Serve then takes the best-ranked replica that has capacity (its own
max_ongoing_requests check still applies).

The counts are this router's own: each deployment handle has a router, so they are
exact for a single caller (the run's rollout stage, which sends all training traffic)
and a per-caller approximation with several. Ties go to the replica with fewer
requests, then at random. Calls other than `generate` (stats, weight digests) carry
no budget and go to any replica.
"""

from __future__ import annotations

import random
from collections import defaultdict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from areal_ray.rollout.engines.base import GenerationRequest

GENERATE_METHODS = ("generate", "generate_batch")


def request_cost(pending: PendingRequest) -> int:
    """The decode budget of a `generate(request)` call, or the summed budgets of a
    `generate_batch(requests)`: the `max_new_tokens` of the `GenerationRequest`s the
    call carries; 0 for any other call."""
    if pending.metadata.call_method not in GENERATE_METHODS:
        return 0
    cost = 0
    for sent in (*pending.args, *pending.kwargs.values()):
        for req in sent if isinstance(sent, (list, tuple)) else (sent,):
            if isinstance(req, GenerationRequest):
                cost += req.max_new_tokens
    return cost


class LeastOutstandingTokensRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._tokens: dict[ReplicaID, int] = defaultdict(int)
        self._requests: dict[ReplicaID, int] = defaultdict(int)
        self._routed: dict[str, tuple[ReplicaID, int]] = {}  # request id -> (replica, cost)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None and request_cost(pending_request) == 0:
            # A control call (stats, digests): any replica, so each one can be reached.
            return [[r] for r in random.sample(candidate_replicas, len(candidate_replicas))]
        order = sorted(candidate_replicas, key=lambda r: (
            self._tokens[r.replica_id], self._requests[r.replica_id], random.random()))
        return [[r] for r in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        cost = request_cost(pending_request)
        self._routed[pending_request.metadata.internal_request_id] = (replica_id, cost)
        self._tokens[replica_id] += cost
        self._requests[replica_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            self._tokens[routed[0]] -= routed[1]
            self._requests[routed[0]] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._tokens.pop(replica_id, None)
        self._requests.pop(replica_id, None)

    def outstanding(self) -> dict[str, int]:
        """Budget routed and not completed, per replica id (for tests and debugging)."""
        return {rid.unique_id: n for rid, n in self._tokens.items()}
