"""The least-outstanding-tokens router's cost of a call, read from the typed requests
it carries (no Serve: a pending request is its method name, args and kwargs)."""

import random
from types import SimpleNamespace

import pytest

from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.router import Outstanding, request_cost


def pending(method: str, *args, **kwargs):
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), args=args, kwargs=kwargs)


def test_a_generate_call_costs_its_requests_budget():
    assert request_cost(pending("generate", GenerationRequest([5, 6], 40))) == 40
    assert request_cost(pending("generate", request=GenerationRequest([5], 7))) == 7


def test_a_batch_costs_the_sum_of_its_budgets():
    reqs = [GenerationRequest([5], 10), GenerationRequest([6], 30), GenerationRequest([7], 2)]
    assert request_cost(pending("generate_batch", reqs)) == 42
    assert request_cost(pending("generate_batch", requests=reqs)) == 42
    assert request_cost(pending("generate_batch", [])) == 0


def test_other_calls_cost_nothing():
    assert request_cost(pending("stats")) == 0
    assert request_cost(pending("decode_batch", [[1, 2, 3]])) == 0
    # the old positional form carries no typed request, so no budget is guessed from it
    assert request_cost(pending("generate", [5, 6], 40, 1.0)) == 0


# ----------------------------------------------------------------- outstanding budgets

# (events, expected budget per replica): routed (r, id, cost), completed (r, id),
# reconcile (r, running), forget (r)
CASES = [
    ([("routed", "a", "x", 40), ("completed", "a", "x")], {"a": 0}),
    ([("routed", "a", "x", 40), ("routed", "b", "y", 10)], {"a": 40, "b": 10}),
    # routed again after an accepted send (its replica became unavailable): each
    # replica's completion releases its own entry, never the other's
    ([("routed", "a", "x", 40), ("routed", "b", "x", 40), ("completed", "a", "x")], {"a": 0, "b": 40}),
    ([("routed", "a", "x", 40), ("routed", "b", "x", 40), ("completed", "b", "x"),
      ("completed", "a", "x")], {"a": 0, "b": 0}),
    ([("completed", "a", "x")], {}),                                   # a rejected send: nothing held
    # Serve says a runs 1 request: the older of two entries is released
    ([("routed", "a", "x", 40), ("routed", "a", "y", 10), ("reconcile", "a", 1)], {"a": 10}),
    ([("routed", "a", "x", 40), ("reconcile", "a", 3)], {"a": 40}),    # others' requests too
    ([("routed", "a", "x", 40), ("reconcile", "a", 0), ("completed", "a", "x")], {"a": 0}),
    ([("routed", "a", "x", 40), ("forget", "a")], {}),                 # a dead replica
]


@pytest.mark.parametrize("events,expected", CASES)
def test_outstanding_budget(events, expected):
    held = Outstanding()
    for kind, *args in events:
        getattr(held, kind)(*args)
    assert held.by_replica() == expected


CACHE_ROUNDS = 20  # how long a replica's count from Serve stays fresh, in rounds


def simulate(router: bool, n: int = 4000, lost: float = 0.02, seed: int = 0) -> dict:
    """Two replicas, `n` requests of random budgets, each running a few rounds; a share
    `lost` of replica a's completions never arrives (the failure the counts must
    survive: one replica whose requests end in a way that is not reported). Serve's
    count of a replica's requests is known while it was sent something in the last
    CACHE_ROUNDS rounds (its queue-length cache). `router`: rank by `Outstanding.rank`
    (ours); else by the bare held budget (the router before). Returns each replica's
    share of the last 1000 requests."""
    rng = random.Random(seed)
    held, running = Outstanding(), {"a": {}, "b": {}}
    last_sent, got = {"a": -CACHE_ROUNDS, "b": -CACHE_ROUNDS}, {"a": 0, "b": 0}
    for i in range(n):
        def key(r, i=i):
            fresh = len(running[r]) if i - last_sent[r] < CACHE_ROUNDS else None
            return (held.rank(r, fresh) if router else (held.tokens(r), held.requests(r)),
                    rng.random())
        replica = min("ab", key=key)
        rid = f"r{i}"
        running[replica][rid] = rng.randint(1, 6)
        if router:  # the send's answer: Serve's count, this request included
            held.reconcile(replica, len(running[replica]) - 1)
        held.routed(replica, rid, rng.randint(8, 96))
        last_sent[replica] = i
        if i >= n - 1000:
            got[replica] += 1
        for r, reqs in running.items():  # one round: each request runs one tick
            for done in [k for k, left in reqs.items() if left <= 1]:
                del reqs[done]
                if r == "b" or rng.random() >= lost:
                    held.completed(r, done)
            for k in reqs:
                reqs[k] -= 1
    return {r: c / 1000 for r, c in got.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lost_completions_are_settled_by_serves_counts_so_the_spread_stays_even(seed):
    """Over a long run with 2% of one replica's completions lost, the two replicas
    share the last 1000 requests evenly; ranked by the bare held budget (the router
    before), the lost budgets pile up on that replica and it starves."""
    even = simulate(router=True, seed=seed)
    assert all(0.4 <= share <= 0.6 for share in even.values()), even
    drifted = simulate(router=False, seed=seed)
    assert drifted["a"] < 0.1, drifted
