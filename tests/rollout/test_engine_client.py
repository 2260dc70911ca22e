"""The engine client's retry on a lost replica, without Ray: a Serve handle stand-in
whose replicas die a given number of times (Serve's handle is the only thing faked)."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from areal_ray.rollout.engine_client import DRAIN_POLL_S, REPLICA_RETRIES, EngineClient
from areal_ray.rollout.engines.base import GenerationRequest


class _Method:
    def __init__(self, app, name):
        self.app, self.name = app, name

    async def remote(self, *args):
        self.app.calls.append((self.name, args))
        if self.app.deaths:
            self.app.deaths -= 1
            raise self.app.error
        return self.app.answer(self.name, args)


class DyingApp:
    """A handle whose next `deaths` calls fail as if their replica died."""

    def __init__(self, deaths: int, error: Exception | None = None):
        self.deaths, self.error, self.calls = deaths, error or ActorDiedError(), []

    def answer(self, name, args):
        return {"method": name, "args": args}

    def __getattr__(self, name):
        return _Method(self, name)


def client(app, **kw) -> EngineClient:
    return EngineClient(app, backoff_s=0.0, **kw)


def test_a_call_outlives_lost_replicas_and_goes_again_unchanged():
    app = DyingApp(deaths=3)
    out = asyncio.run(client(app).generate_batch([[1, 2]], [5], 0.7))
    sent = ([GenerationRequest([1, 2], 5, 0.7)],)
    assert out == {"method": "generate_batch", "args": sent}
    assert app.calls == [("generate_batch", sent)] * 4


def test_requests_travel_as_typed_requests_not_positional_arguments():
    """What the replica admits and the router reads the budget of (router.request_cost)."""
    app = DyingApp(deaths=0)
    c = client(app)
    (reqs,) = asyncio.run(c.generate_batch([[1], [2, 3]], [4, 9], 0.5, stop_ids=[7],
                                           seeds=[11, None]))["args"]
    assert reqs == [GenerationRequest([1], 4, 0.5, stop_ids=[7], seed=11),
                    GenerationRequest([2, 3], 9, 0.5, stop_ids=[7], seed=None)]
    (req,) = asyncio.run(c.generate([1], 4, 1.0, seed=3))["args"]
    assert req == GenerationRequest([1], 4, 1.0, seed=3)
    with pytest.raises(ValueError, match="2 prompts but 1 max_new_tokens"):
        asyncio.run(c.generate_batch([[1], [2]], [4], 1.0))


def test_each_app_method_is_called_by_name():
    app = DyingApp(deaths=0)
    c = client(app)
    assert asyncio.run(c.encode("1+1="))["args"] == ("1+1=",)
    assert asyncio.run(c.decode_batch([[3]]))["method"] == "decode_batch"
    assert asyncio.run(c.generate([1], 4, 1.0))["args"] == (GenerationRequest([1], 4, 1.0),)


def test_an_app_that_stays_gone_fails_after_the_retries():
    app = DyingApp(deaths=100)
    with pytest.raises(ActorDiedError):
        asyncio.run(client(app, retries=2).encode("x"))
    assert len(app.calls) == 3


def test_other_errors_are_not_retried():
    app = DyingApp(deaths=5, error=ValueError("bad request"))
    with pytest.raises(ValueError, match="bad request"):
        asyncio.run(client(app).encode("x"))
    assert len(app.calls) == 1


def test_backoff_doubles_up_to_its_cap_about_a_minute_in_all():
    c = EngineClient(DyingApp(0))
    waits = [c.backoff(a) for a in range(REPLICA_RETRIES)]
    assert waits[:3] == [0.5, 1.0, 2.0] and max(waits) == 10.0
    assert 40 <= sum(waits) <= 90


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="retries"):
        EngineClient(DyingApp(0), retries=-1)


def test_every_deployment_of_the_app_drains_at_the_clients_poll():
    """A stopping replica of the rollout app and of its OpenAI endpoint waits
    DRAIN_POLL_S (not Serve's 2 s) before it counts its ongoing requests: a job's end
    waits that long for its app; a call that reaches a stopped replica is retried."""
    from areal_ray.config import load_config
    from deployments.openai_api import build_openai_app
    from deployments.rollout import build_app

    cfg = load_config("conf/agents_sdk.yaml", ["rollout.openai.api_key=a-test-key-of-24-chars", "rollout.openai.replicas=2"])
    app = build_app(cfg, "model")
    endpoint = build_openai_app(cfg, app, "model")
    shards = endpoint._bound_deployment.init_args[3]
    for bound in (app, endpoint, *shards):
        assert bound._bound_deployment._deployment_config.graceful_shutdown_wait_loop_s == DRAIN_POLL_S
    assert len(shards) == 1 and DRAIN_POLL_S < 2.0
