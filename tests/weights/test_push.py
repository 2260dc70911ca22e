"""Weight pushes from a trainer process to real rollout Serve replicas through the
driver, on every path: bit-identical weights everywhere; a replica killed before a
collective push neither hangs it nor stops the others; a replica that (re)joins
serves the current weights."""

import os
import signal
import time
import uuid

import pytest
import ray
import torch
from ray import serve
from ray._private import state
from transformers import AutoModelForCausalLM

from areal_ray.cluster.placement import delete_app
from areal_ray.config import WeightsConfig, load_config
from areal_ray.driver import Driver
from areal_ray.weights.encoding import digest
from areal_ray.weights.push import WeightPusher
from deployments.rollout import build_app


def replica_reports(handle, n: int, method: str = "weights_digest",
                    timeout_s: float = 90.0) -> dict[str, dict]:
    """{replica_id: answer of `method`} once n distinct live replicas have answered."""
    seen, t0 = {}, time.time()
    while len(seen) < n:
        assert time.time() - t0 < timeout_s, f"only {len(seen)} of {n} replicas answered"
        d = getattr(handle, method).remote().result(timeout_s=timeout_s)
        seen[d["replica_id"]] = d
    return seen


def replica_digests(handle, n: int, timeout_s: float = 90.0) -> dict[str, tuple[int, str]]:
    """{replica_id: (version, digest)} once n distinct live replicas have answered."""
    return {k: (d["version"], d["digest"])
            for k, d in replica_reports(handle, n, timeout_s=timeout_s).items()}


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))


def start_app(embedded_model, replicas: int, name: str = "push",
              overrides=("weights.timeout_s=5.0",), **driver_options):
    """A driver and a rollout app of `replicas` hf replicas registered with it."""
    tag = uuid.uuid4().hex[:6]
    driver = Driver.options(name=f"drv-{tag}").remote(eta=1, batch_groups=1, push_timeout_s=15.0,
                                                     **driver_options)
    ns = ray.get_runtime_context().namespace
    serve.start(proxy_location="Disabled")
    app = f"{name}-{tag}"
    cfg = load_config(None, [f"rollout.min_replicas={replicas}", f"rollout.max_replicas={replicas}",
                             "rollout.num_cpus=0.5", *overrides])
    handle = serve.run(build_app(cfg, embedded_model, f"drv-{tag}", ns), name=app, route_prefix=None)
    return driver, handle, app


def stop_app(driver, app) -> None:
    delete_app(app)
    ray.kill(driver)


@pytest.fixture(scope="module")
def one_replica(ray_cluster, embedded_model):
    """One replica for the module's push tests, which take turns on it (a replica takes
    ~10 s to start): each pushes the versions after the previous test's (`next_version`),
    as the successive pushers of a restarted trainer would."""
    driver, handle, app = start_app(embedded_model, 1)
    versions = iter(range(1, 1000))
    yield driver, handle, lambda: next(versions)
    stop_app(driver, app)


@pytest.fixture
def two_replicas(ray_cluster, embedded_model):
    driver, handle, app = start_app(embedded_model, 2)
    yield driver, handle, app
    stop_app(driver, app)


@pytest.mark.parametrize("path,expected", [
    ("collective", "collective"), ("object_store", "object_store"), ("disk", "disk"),
    ("shm", "shm"), ("auto", "shm"),  # auto: every replica is on this node -> shared memory
])
def test_every_path_delivers_bit_identical_weights(one_replica, embedded_model, tmp_path, path,
                                                   expected):
    driver, handle, next_version = one_replica
    model = AutoModelForCausalLM.from_pretrained(embedded_model)
    pusher = WeightPusher(WeightsConfig(path=path, bucket_mb=1, timeout_s=10.0), driver, 0,
                          str(tmp_path / "weights"))
    try:
        for _ in range(2):  # the second collective push reuses the group
            version = next_version()
            perturb(model, version)
            weights, stats = pusher.push(model, version)
            assert stats["push_path"] == expected and stats["replicas"] == 1 and stats["push_dropped"] == 0
            assert stats["push_bytes"] == sum(v.numel() * v.element_size() for v in weights.values())
            assert {v for v in replica_digests(handle, 1).values()} == {(version, digest(model.state_dict()))}
    finally:
        pusher.close()


def test_every_path_delivers_a_bit_identical_adapter(one_replica, embedded_model, tmp_path):
    """model.lora: each path carries the adapter alone (an `AdapterPayload` of the base,
    at the push's version), and the replica's hf engine then serves exactly the merged
    model the trainer's exports hold (weights/adapter.py: merged_state). (The replica
    first gets the base back: the module's other tests pushed other weights.)"""
    from areal_ray.config import LoraConfig
    from areal_ray.train.lora import adapter_meta, adapter_state, apply_lora
    from areal_ray.weights.adapter import Adapter, merged_state
    driver, handle, next_version = one_replica
    model = AutoModelForCausalLM.from_pretrained(embedded_model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    full = WeightPusher(WeightsConfig(path="object_store"), driver, 0, str(tmp_path / "weights"))
    version = next_version()
    full.push(model, version)
    assert set(replica_digests(handle, 1).values()) == {(version, digest(base))}
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    model = apply_lora(model, lora)
    meta = adapter_meta(model, lora, embedded_model, "float32")
    adapter_bytes = sum(v.numel() * 4 for v in adapter_state(model).values())
    paths = [("collective", "collective"), ("object_store", "object_store"), ("disk", "disk"),
             ("shm", "shm"), ("auto", "shm"), ("collective", "collective")]
    for path, expected in paths:
        version = next_version()
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # the adapter's: a step of the trainer
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
        pusher = WeightPusher(WeightsConfig(path=path, bucket_mb=1, timeout_s=10.0), driver, 0,
                              str(tmp_path / "weights"), adapter=meta)
        try:
            weights, stats = pusher.push(model, version)
        finally:
            pusher.close()
        assert stats["push_path"] == expected and stats["replicas"] == 1, (path, stats)
        assert stats["push_bytes"] == adapter_bytes and weights.keys() == adapter_state(model).keys()
        want = digest(merged_state(base, Adapter(meta, weights)))
        assert set(replica_digests(handle, 1).values()) == {(version, want)}, path
    assert want != digest(base)


def test_a_dead_replica_is_dropped_and_a_restarted_one_catches_up(two_replicas, embedded_model,
                                                                  tmp_path):
    driver, handle, app = two_replicas
    model = AutoModelForCausalLM.from_pretrained(embedded_model)
    pusher = WeightPusher(WeightsConfig(path="collective", bucket_mb=1, timeout_s=5.0), driver, 0,
                          str(tmp_path))
    perturb(model, 1)
    _, stats = pusher.push(model, 1)
    assert stats["push_path"] == "collective" and stats["replicas"] == 2
    assert set(replica_digests(handle, 2).values()) == {(1, digest(model.state_dict()))}

    victim = next(a for a in state.actors().values()
                  if a["State"] == "ALIVE" and f"ServeReplica:{app}" in a["ActorClassName"])
    os.kill(victim["Pid"], signal.SIGKILL)
    perturb(model, 2)
    t0 = time.time()
    _, stats = pusher.push(model, 2)  # the dead member fails the group: no hang, fallback
    assert stats["push_path"] == "object_store (fallback)"
    assert time.time() - t0 < 60
    # Serve restarts the replica; it registers and loads the current version first
    assert set(replica_digests(handle, 2).values()) == {(2, digest(model.state_dict()))}
    perturb(model, 3)
    _, stats = pusher.push(model, 3)  # a new group of the live replicas
    assert stats["push_path"] == "collective" and stats["replicas"] == 2
    assert set(replica_digests(handle, 2).values()) == {(3, digest(model.state_dict()))}


def test_the_load_probe_passes_real_pushes_and_fails_one_that_changed_nothing(
        ray_cluster, embedded_model, tmp_path):
    """weights/probe.py end to end, under the moved rule (the rule of bf16 runs): a real
    replica (Serve app, hf engine) scores the model on disk as it registers and the probe
    after each load, and acks it to a real driver; the trainer's pusher gives the
    driver its probe of the same model on disk. A push through the pusher is followed
    all the way (bit for bit here); a publication that carries the previous weights
    while the trainer expects new ones (the replica loads, acks, and still computes the
    old version) fails the push naming the replica, the version and the share followed."""
    from areal_ray.train.probe import model_probe
    from areal_ray.weights.probe import ProbeMismatch, ProbeRule
    driver, handle, app = start_app(embedded_model, 1, "probe", (), probe=ProbeRule())
    try:
        replica_digests(handle, 1)  # registered and serving
        model = AutoModelForCausalLM.from_pretrained(embedded_model)
        weights = str(tmp_path / "weights")
        pusher = WeightPusher(WeightsConfig(path="object_store"), driver, 0, weights, probe=True)
        pusher.baseline(model)  # the model on disk, as the replica registered with it
        perturb(model, 1)
        _, stats = pusher.push(model, 1)
        assert stats["probe_max_diff"] == 0.0 and stats["probe_trainer_s"] > 0
        assert stats["probe_moved"] == pytest.approx(1.0) and stats["probe_unseen"] == 0
        stale = {k: v.clone() for k, v in model.state_dict().items()}
        perturb(model, 2)
        ray.get(driver.expect_probe.remote(2, *model_probe(model)))  # the trainer's v2 ...
        silent = WeightPusher(WeightsConfig(path="object_store"), driver, 0, weights)
        model.load_state_dict(stale)  # ... but the publication carries v1's weights
        with pytest.raises(ProbeMismatch, match=r"replica .* does not serve v2: since v1 the "
                                                r"trainer's probe .* the replica's followed 0%"):
            silent.push(model, 2)
    finally:
        stop_app(driver, app)
