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

The counts must not drift over a long run: a budget that is never released makes its
replica look busy to every later request, and it would slowly starve. So
(`Outstanding`) each routed request is held per (replica, request id): a completion
releases only the entry of the replica it names (a request routed again after an
accepted send, on a replica that became unavailable, must not release the new
replica's entry, leaving the old one for good); when Serve knows how many requests
a replica is running (its queue-length answers and cache), entries beyond that
count are released, the oldest first, since they cannot still be running there; a
dead replica's entries go with it. A replica that holds budget Serve has not
confirmed lately (no fresh count: it was sent nothing for Serve's cache timeout)
ranks as idle, so Serve probes it, sends it the request, and its answer settles the
count: at most one request per cache timeout lands on a replica that was in fact
busy, and a replica whose budget was never released cannot starve. `outstanding()`
is each replica's budget now.
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

from areal_ray.observe.metrics import RouterMetrics
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


class Outstanding:
    """The budget routed to each replica and not completed (pure: no Serve). Totals
    are kept beside the entries: every routed request ranks each replica by them."""

    def __init__(self):
        # replica -> {request id: cost}, oldest first (dicts keep insertion order)
        self._by_replica: dict[object, dict[str, int]] = defaultdict(dict)
        self._tokens: dict[object, int] = defaultdict(int)

    def routed(self, replica, request_id: str, cost: int) -> None:
        self.completed(replica, request_id)  # the same id sent there again replaces it
        self._by_replica[replica][request_id] = cost
        self._tokens[replica] += cost

    def completed(self, replica, request_id: str) -> None:
        cost = self._by_replica.get(replica, {}).pop(request_id, None)
        if cost is not None:
            self._tokens[replica] -= cost

    def reconcile(self, replica, running: int) -> None:
        """Serve says `replica` runs `running` requests (from every caller): more
        entries than that cannot all be live; the oldest are released."""
        held = self._by_replica.get(replica)
        while held and len(held) > max(0, running):
            self._tokens[replica] -= held.pop(next(iter(held)))

    def forget(self, replica) -> None:
        self._by_replica.pop(replica, None)
        self._tokens.pop(replica, None)

    def rank(self, replica, serve_count: int | None) -> tuple[int, int]:
        """(budget, requests) to rank `replica` by, given Serve's count of the requests
        it runs (None: not known lately). Held budget Serve has not confirmed ranks
        as none, so that the replica is probed and its count settles ours."""
        if serve_count is not None:
            self.reconcile(replica, serve_count)
        elif self.requests(replica):
            return (0, 0)
        return (self.tokens(replica), self.requests(replica))

    def tokens(self, replica) -> int:
        return self._tokens.get(replica, 0)

    def requests(self, replica) -> int:
        return len(self._by_replica.get(replica, {}))

    def by_replica(self) -> dict:
        return {r: self._tokens[r] for r in self._by_replica}


class LeastOutstandingTokensRouter(RequestRouter):
    def initialize_state(self, run: str = "", **kwargs) -> None:
        """`run`: the run's name, the tag of the outstanding-budget gauge."""
        self._outstanding = Outstanding()
        self._metrics = RouterMetrics(run)

    def _report(self, replica_id: ReplicaID) -> None:
        self._metrics.outstanding(replica_id.unique_id, self._outstanding.tokens(replica_id))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None and request_cost(pending_request) == 0:
            # A control call (stats, digests): any replica, so each one can be reached.
            return [[r] for r in random.sample(candidate_replicas, len(candidate_replicas))]
        keys = {r.replica_id: (*self._outstanding.rank(r.replica_id, self._serve_count(r.replica_id)),
                               random.random()) for r in candidate_replicas}
        return [[r] for r in sorted(candidate_replicas, key=lambda r: keys[r.replica_id])]

    def _serve_count(self, replica_id: ReplicaID) -> int | None:
        """Serve's own count of the requests a replica runs, when fresh (its queue-length
        cache: set by each send's answer and by probes, lowered as requests end)."""
        if not getattr(self, "_use_replica_queue_len_cache", False):
            return None
        return self._replica_queue_len_cache.get(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        self._outstanding.routed(replica_id, pending_request.metadata.internal_request_id,
                                 request_cost(pending_request))
        self._report(replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._outstanding.completed(replica_id, internal_request_id)
        self._report(replica_id)

    def on_new_queue_len_info(self, replica_id: ReplicaID, num_ongoing_requests: int) -> None:
        super().on_new_queue_len_info(replica_id, num_ongoing_requests)
        self._outstanding.reconcile(replica_id, num_ongoing_requests)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._outstanding.forget(replica_id)

    def outstanding(self) -> dict[str, int]:
        """Budget routed and not completed, per replica id (for tests and debugging)."""
        return {rid.unique_id: n for rid, n in self._outstanding.by_replica().items()}
