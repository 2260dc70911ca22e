"""The rollout Serve app on the local cluster: hundreds of concurrent requests, routing
by outstanding tokens, a replica added mid-run serving the current version before its
first request, and rolling updates that swap one replica at a time."""

import asyncio
import random
import threading
import time
import uuid

import pytest
import ray
from ray import serve
from transformers import AutoModelForCausalLM

from areal_ray.cluster.placement import delete_app
from areal_ray.config import WeightsConfig, load_config
from areal_ray.driver import Driver
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.weights.encoding import digest
from areal_ray.weights.push import WeightPusher
from deployments.rollout import build_app
from tests.weights.test_push import perturb, replica_digests, replica_reports


@pytest.fixture
def deploy(ray_cluster, embedded_model):
    """deploy(overrides, driver_name="", app="") -> (handle, app); torn down after the test.
    Deploying again under the same app name updates it in place (e.g. scales it)."""
    apps = set()

    def _deploy(overrides, driver_name="", app=""):
        app = app or f"rollout-{uuid.uuid4().hex[:6]}"
        cfg = load_config(None, ["rollout.num_cpus=0.5", *overrides])
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(cfg, embedded_model, driver_name,
                                     ray.get_runtime_context().namespace),
                           name=app, route_prefix=None)
        apps.add(app)
        return handle, app

    yield _deploy
    for app in apps:
        delete_app(app)


@pytest.fixture
def driver(ray_cluster):
    name = f"drv-{uuid.uuid4().hex[:6]}"
    handle = Driver.options(name=name).remote(eta=1, batch_groups=1, push_timeout_s=30.0)
    yield name, handle
    ray.kill(handle)


def serve_replicas(app: str) -> int:
    """How many replicas Serve runs or starts for `app`'s one deployment: once the
    autoscaler has decided on a second, more demand only burns the CPU its start needs
    (Serve's downscale delay, 600 s by default, keeps the decision)."""
    (deployment,) = serve.status().applications[app].deployments.values()
    return sum(n for state, n in deployment.replica_states.items()
               if state in ("STARTING", "UPDATING", "RECOVERING", "RUNNING"))


def req(ids: list[int], budget: int) -> GenerationRequest:
    """A request that generates its whole budget (what the replica's methods take)."""
    return GenerationRequest(ids, budget, 1.0, ignore_eos=True)


def replica_stats(handle, n: int, timeout_s: float = 90.0) -> dict[str, dict]:
    return replica_reports(handle, n, "stats", timeout_s)


def test_hundreds_of_concurrent_requests_all_complete(deploy):
    handle, _ = deploy(["rollout.min_replicas=2", "rollout.max_replicas=2"])
    rng = random.Random(0)
    budgets = [rng.randint(1, 40) for _ in range(240)]

    async def fire():
        return await asyncio.gather(*[handle.generate.remote(req([5, 6, 7 + i % 9], n))
                                      for i, n in enumerate(budgets)])

    results = asyncio.run(fire())
    assert [len(r["output_ids"]) for r in results] == budgets
    assert all(r["stop_reason"] == "length" and r["versions"] == [0] * len(r["output_ids"])
               for r in results)
    served = {k: s["requests"] for k, s in replica_stats(handle, 2).items()}
    assert sum(served.values()) >= len(budgets) and min(served.values()) > 0


def test_short_requests_are_routed_away_from_a_long_one(deploy):
    """With long generations on one replica, the other has fewer outstanding tokens:
    every short request goes there (Serve's default compares request counts of two
    random replicas, which sends some of them to the busy one)."""
    handle, _ = deploy(["rollout.min_replicas=2", "rollout.max_replicas=2",
                        "rollout.router=least_tokens"])
    replica_stats(handle, 2)  # both up

    # a batch call (what the rollout stage sends per group) counts its summed budget
    long = handle.generate_batch.remote([req([5, 6], 50_000), req([5, 7], 50_000)])
    t0 = time.time()
    while not any(s["running"] for s in replica_stats(handle, 2).values()):
        assert time.time() - t0 < 60, "the long request never started"
    shorts = [handle.generate.remote(req([5, 6], 4)).result() for _ in range(6)]
    assert all(len(r["output_ids"]) == 4 for r in shorts)
    stats = replica_stats(handle, 2).values()
    (busy,) = [s for s in stats if s["running"]]  # the long request is still running there
    (idle,) = [s for s in stats if not s["running"]]
    assert idle["requests"] == 6 and busy["requests"] == 0
    long.cancel()


def test_a_replica_added_by_autoscaling_serves_the_current_version(driver, deploy,
                                                                  embedded_model, tmp_path):
    name, drv = driver
    handle, app = deploy(["rollout.min_replicas=1", "rollout.max_replicas=2",
                          "rollout.target_ongoing_requests=2", "rollout.upscale_delay_s=1"],
                         driver_name=name)
    model = AutoModelForCausalLM.from_pretrained(embedded_model)
    pusher = WeightPusher(WeightsConfig(path="object_store"), drv, 0, str(tmp_path))
    for version in (1, 2):
        perturb(model, version)
        pusher.push(model, version)
    (first,) = replica_stats(handle, 1)
    # Demand far above the target, kept up (a request's budget ends at the model's
    # context) until Serve starts a second replica. It registers with the driver and
    # loads version 2 in its constructor, before Serve routes anything to it.
    stop = threading.Event()

    def keep_busy():
        while not stop.is_set():
            handle.generate.remote(req([5, 6], 250)).result()
    demand = [threading.Thread(target=keep_busy, daemon=True) for _ in range(24)]
    for t in demand:
        t.start()
    try:
        deadline = time.time() + 180
        while serve_replicas(app) < 2:
            assert time.time() < deadline, "Serve added no replica"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in demand:
            t.join(120)
    stats = replica_stats(handle, 2, timeout_s=180)
    (new,) = set(stats) - {first}
    assert stats[new]["version"] == 2 and [u["version"] for u in stats[new]["updates"]] == [2]
    assert set(replica_digests(handle, 2).values()) == {(2, digest(model.state_dict()))}
    assert set(ray.get(drv.replicas.remote())) == set(stats)
    results = [handle.generate.remote(req([5, 6], 8)) for _ in range(40)]
    assert all(r.result()["versions"] == [2] * 8 for r in results)
    assert replica_stats(handle, 2)[new]["requests"] > 0  # the new replica served them


def test_rolling_updates_swap_one_replica_at_a_time(driver, deploy, embedded_model, tmp_path):
    name, drv = driver
    handle, _ = deploy(["rollout.min_replicas=2", "rollout.max_replicas=2",
                        "rollout.rolling_update=true"], driver_name=name)
    replica_stats(handle, 2)
    model = AutoModelForCausalLM.from_pretrained(embedded_model)
    pusher = WeightPusher(WeightsConfig(path="object_store"), drv, 0, str(tmp_path))
    load = [handle.generate.remote(req([5, 6], 200)) for _ in range(16)]  # busy replicas
    for version in (1, 2, 3):
        perturb(model, version)
        _, stats = pusher.push(model, version)
        assert stats["replicas"] == 2
    windows = sorted((u["start"], u["end"], u["version"])
                     for s in replica_stats(handle, 2).values() for u in s["updates"])
    assert [v for *_, v in windows] == [1, 1, 2, 2, 3, 3]
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:]))  # never two at once
    for r in load:  # interrupted requests came back with their partial output
        out = r.result()
        assert out["stop_reason"] in ("abort", "length") and len(set(out["versions"])) <= 1
