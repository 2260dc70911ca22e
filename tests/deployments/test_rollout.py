"""The rollout Serve app on the local cluster: a replica added mid-run by autoscaling
serving the current version before its first request, hundreds of concurrent requests,
routing by outstanding tokens, and rolling updates that swap one replica at a time.

One app for the module, as a run has one (each hf replica's start cost ~11 CPU-s; an
app per test started eight): autoscaled from one replica to two, least-tokens routing,
rolling updates. The first test watches the second replica start; each later one
starts from two (`two_replicas`) and counts what it did from its own start: a
replica's request count and its list of updates cover the replica's life.
"""

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


@pytest.fixture(scope="module")
def app(ray_cluster, embedded_model):
    tag = uuid.uuid4().hex[:6]
    name = f"drv-{tag}"
    drv = Driver.options(name=name).remote(eta=1, batch_groups=1, push_timeout_s=30.0)
    cfg = load_config(None, [
        "rollout.num_cpus=0.5", "rollout.min_replicas=1", "rollout.max_replicas=2",
        "rollout.target_ongoing_requests=2", "rollout.upscale_delay_s=1",
        "rollout.rolling_update=true"])
    serve.start(proxy_location="Disabled")
    appname = f"rollout-{tag}"
    handle = serve.run(build_app(cfg, embedded_model, name, ray.get_runtime_context().namespace),
                       name=appname, route_prefix=None)
    model = AutoModelForCausalLM.from_pretrained(embedded_model)
    yield {"driver": drv, "handle": handle, "model": model, "version": 0, "name": appname}
    delete_app(appname)
    ray.kill(drv)


def push(app, tmp_path, path="object_store"):
    """The module's next version: the model perturbed, pushed over `path`."""
    app["version"] += 1
    perturb(app["model"], app["version"])
    pusher = WeightPusher(WeightsConfig(path=path, bucket_mb=1, timeout_s=30.0), app["driver"], 0,
                          str(tmp_path / "weights"))
    try:
        _, stats = pusher.push(app["model"], app["version"])
    finally:
        pusher.close()
    return stats


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


def two_replicas(app) -> dict[str, dict]:
    """Demand above the autoscaling target until Serve starts a second replica
    (requests end within a second here, so 12 workers keep resubmitting), then its
    start-up, which registers it with the driver."""
    handle, driver = app["handle"], app["driver"]

    async def demand():
        done = asyncio.Event()

        async def worker():
            while not done.is_set():
                await handle.generate.remote(req([5, 6], 240))

        async def watch():
            deadline = time.time() + 240
            while serve_replicas(app["name"]) < 2:
                assert time.time() < deadline, "Serve added no replica"
                await asyncio.sleep(0.2)
            done.set()
        await asyncio.gather(watch(), *[worker() for _ in range(12)])

    if len(ray.get(driver.replicas.remote())) < 2:
        if serve_replicas(app["name"]) < 2:
            asyncio.run(demand())
        deadline = time.time() + 240
        while len(ray.get(driver.replicas.remote())) < 2:
            assert time.time() < deadline, "the second replica never registered"
            time.sleep(0.5)
    return replica_stats(handle, 2)


def requests_since(before: dict[str, dict], after: dict[str, dict]) -> dict[str, int]:
    return {k: after[k]["requests"] - before.get(k, {}).get("requests", 0) for k in after}


def test_a_replica_added_by_autoscaling_serves_the_current_version(app, tmp_path):
    handle = app["handle"]
    push(app, tmp_path)
    push(app, tmp_path)
    version, model = app["version"], app["model"]
    (first,) = replica_stats(handle, 1)
    # Demand far above the target, kept up (a request's budget ends at the model's
    # context) until Serve starts a second replica. It registers with the driver and
    # loads the current version in its constructor, before Serve routes anything to it.
    stop = threading.Event()

    def keep_busy():
        while not stop.is_set():
            handle.generate.remote(req([5, 6], 250)).result()
    demand = [threading.Thread(target=keep_busy, daemon=True) for _ in range(24)]
    for t in demand:
        t.start()
    try:
        deadline = time.time() + 180
        while serve_replicas(app["name"]) < 2:
            assert time.time() < deadline, "Serve added no replica"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in demand:
            t.join(120)
    stats = replica_stats(handle, 2, timeout_s=180)
    (new,) = set(stats) - {first}
    assert stats[new]["version"] == version and [u["version"] for u in stats[new]["updates"]] == [version]
    assert set(replica_digests(handle, 2).values()) == {(version, digest(model.state_dict()))}
    assert set(ray.get(app["driver"].replicas.remote())) == set(stats)
    before = replica_stats(handle, 2)
    results = [handle.generate.remote(req([5, 6], 8)) for _ in range(40)]
    assert all(r.result()["versions"] == [version] * 8 for r in results)
    assert requests_since(before, replica_stats(handle, 2))[new] > 0  # the new replica served some


def test_hundreds_of_concurrent_requests_all_complete(app):
    two_replicas(app)
    # A handle of its own: the router's counts are per handle, and the module's handle
    # carries what earlier tests routed through it.
    handle = serve.get_app_handle(app["name"])
    before = replica_stats(handle, 2)
    rng = random.Random(0)
    budgets = [rng.randint(1, 40) for _ in range(240)]

    async def fire():
        return await asyncio.gather(*[handle.generate.remote(req([5, 6, 7 + i % 9], n))
                                      for i, n in enumerate(budgets)])

    # Waves until both replicas have served some (at most 3): a new handle's router can
    # send a first wave before it has the second replica (as in test_rollout_vllm.py);
    # every request of every wave must complete.
    for _ in range(3):
        results = asyncio.run(fire())
        assert [len(r["output_ids"]) for r in results] == budgets
        assert all(r["stop_reason"] == "length" and
                   r["versions"] == [app["version"]] * len(r["output_ids"]) for r in results)
        served = requests_since(before, replica_stats(handle, 2))
        if min(served.values()) > 0:
            break
    assert sum(served.values()) >= len(budgets) and min(served.values()) > 0, served


def test_short_requests_are_routed_away_from_a_long_one(app):
    """With long generations on one replica, the other has fewer outstanding tokens:
    every short request goes there (Serve's default compares request counts of two
    random replicas, which sends some of them to the busy one)."""
    two_replicas(app)
    handle = serve.get_app_handle(app["name"])
    before = replica_stats(handle, 2)
    # a batch call (what the rollout stage sends per group) counts its summed budget
    long = handle.generate_batch.remote([req([5, 6], 50_000), req([5, 7], 50_000)])
    t0 = time.time()
    while not any(s["running"] for s in replica_stats(handle, 2).values()):
        assert time.time() - t0 < 60, "the long request never started"
    shorts = [handle.generate.remote(req([5, 6], 4)).result() for _ in range(6)]
    assert all(len(r["output_ids"]) == 4 for r in shorts)
    stats = replica_stats(handle, 2)
    served = requests_since(before, stats)
    (busy,) = [k for k, s in stats.items() if s["running"]]  # the long request is still running there
    (idle,) = [k for k, s in stats.items() if not s["running"]]
    assert served[idle] == 6 and served[busy] == 0
    long.cancel()


def test_rolling_updates_swap_one_replica_at_a_time(app, tmp_path):
    two_replicas(app)
    handle = app["handle"]
    start = app["version"]
    load = [handle.generate.remote(req([5, 6], 200)) for _ in range(16)]  # busy replicas
    for _ in range(3):
        assert push(app, tmp_path)["replicas"] == 2
    windows = sorted((u["start"], u["end"], u["version"])
                     for s in replica_stats(handle, 2).values() for u in s["updates"]
                     if u["version"] > start)
    assert [v for *_, v in windows] == [start + 1, start + 1, start + 2, start + 2, start + 3, start + 3]
    assert all(a[1] <= b[0] for a, b in zip(windows, windows[1:]))  # never two at once
    for r in load:  # interrupted requests came back with their partial output
        out = r.result()
        assert out["stop_reason"] in ("abort", "length") and len(set(out["versions"])) <= 1
