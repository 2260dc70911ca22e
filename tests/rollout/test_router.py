"""The least-outstanding-tokens router's cost of a call, read from the typed requests
it carries (no Serve: a pending request is its method name, args and kwargs)."""

from types import SimpleNamespace

from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.router import request_cost


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
