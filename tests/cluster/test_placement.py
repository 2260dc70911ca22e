"""Placement against a real local Ray cluster (areal_ray/cluster/placement.py): an
impossible run is refused before anything is deployed, and every wait for placement
(Serve replicas, Ray Train workers) ends at the deadline with a message naming what
could not be placed, instead of waiting forever."""

import json
import os
import subprocess
import sys

import pytest

from areal_ray.cluster.placement import (
    PlacementError,
    bound_train_start,
    check_placement,
    check_run_dir,
    cluster_nodes,
    delete_app,
    deploy_app,
    train_start_problem,
)
from areal_ray.cluster.plan import REPLICA, TRAINER, Demand, cluster_shape, demands, place
from areal_ray.config import ConfigError, load_config
from jobs import train as train_job


def test_a_run_asking_for_a_gpu_is_refused_before_anything_starts(ray_cluster, capsys):
    from ray import serve
    cfg = load_config("conf/quickstart.yaml", ["rollout.num_gpus=1"])
    with pytest.raises(PlacementError, match=r"asks for 1 GPU .* the cluster has 0 GPU"):
        check_placement(cfg, nodes=cluster_nodes())
    before = set(serve.status().applications) if serve.status() else set()
    # the job: exit status 2 and the message, and no rollout app was deployed
    assert train_job.main(["--config", "conf/quickstart.yaml", "rollout.num_gpus=1",
                           "run.eval_before=false"]) == 2
    err = capsys.readouterr().err
    assert "cannot be placed" in err and "rollout replica x1" in err
    assert not {a for a in serve.status().applications if a.startswith("areal-rollout")} - before


def test_serve_app_that_cannot_be_placed_fails_at_the_deadline(ray_cluster):
    from ray import serve

    # never placed: deleting it need not wait out the default 20 s graceful shutdown
    @serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"no_such_accelerator": 1}},
                      graceful_shutdown_timeout_s=1)
    class Unplaceable:
        def __call__(self):
            return "never"

    serve.start(proxy_location="Disabled")
    try:
        with pytest.raises(PlacementError, match=r"not running after run.placement_timeout_s=3.*"
                                                 r"deployment Unplaceable"):
            deploy_app(Unplaceable.bind(), "placement-test", timeout_s=3)
    finally:
        serve.delete("placement-test")


def test_a_deleted_app_is_gone_when_delete_app_returns_and_its_replica_ends(ray_cluster):
    import time

    from ray import serve
    from ray._private import state

    @serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=0.25)
    class Echo:
        def __call__(self):
            return "ok"

    serve.start(proxy_location="Disabled")
    serve.run(Echo.bind(), name="delete-test", route_prefix=None)
    replicas = {a["ActorID"] for a in state.actors().values()
                if a["ActorClassName"] == "ServeReplica:delete-test:Echo" and a["State"] == "ALIVE"}
    assert len(replicas) == 1
    delete_app("delete-test")
    assert "delete-test" not in serve.status().applications
    deadline = time.monotonic() + 10  # Serve has stopped it; the GCS may note it a moment later
    while {state.actors()[a]["State"] for a in replicas} != {"DEAD"}:
        assert time.monotonic() < deadline, [state.actors()[a]["State"] for a in replicas]
        time.sleep(0.1)
    delete_app("delete-test")  # an app that is not there: nothing to wait for


def test_trainer_that_cannot_be_placed_fails_at_the_deadline(ray_cluster, tmp_path, monkeypatch):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
    bound_train_start(3)
    cfg = load_config("conf/quickstart.yaml", ["run.placement_timeout_s=3"])
    trainer = TorchTrainer(
        lambda: None,
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1, "no_such_accelerator": 1}),
        run_config=RunConfig(name="placement", storage_path=str(tmp_path),
                             failure_config=FailureConfig(controller_failure_limit=0)))
    with pytest.raises(Exception) as got:
        trainer.fit()
    msg = train_start_problem(got.value, cfg)
    assert msg is not None and "could not be placed within run.placement_timeout_s=3" in msg


def test_the_run_dir_check_reads_the_live_cluster(ray_cluster, tmp_path):
    import ray
    cfg = load_config("conf/quickstart.yaml")
    check_run_dir(cfg, str(tmp_path))  # one node: the job's own disk will do
    # a second node with a worker's resources, as ray.nodes() would list it
    (me,) = [n for n in ray.nodes() if n["Alive"]]
    other = {**me, "NodeID": "f" * len(me["NodeID"]), "NodeManagerAddress": "10.9.9.9"}
    with pytest.raises(ConfigError, match=r"may run on 2 nodes \(.*, 10.9.9.9\)"):
        check_run_dir(cfg, str(tmp_path), nodes=[me, other])


# Ray's own scheduler on a cluster of its own with two fake GPUs (the session's has none,
# and the GPU count of a cluster is fixed at its start): each step starts actors asking
# for GPU shares one after another, as plain actors (Serve's replicas) or in a PACK
# placement group (Ray Train's worker group), and each reports the GPU Ray gave it.
FAKE_GPUS = """
import json, sys, time, ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
ray.init(address="local", num_cpus=1, num_gpus=2, include_dashboard=False,
         logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=0)
class Holder:
    def gpus(self):
        return ray.get_gpu_ids()

out = []
for case in json.loads(sys.argv[1]):
    held, groups, got = [], [], []
    for kind, shares in case:
        pg = None
        if kind == "pack":
            pg = placement_group([{"GPU": s} for s in shares], strategy="PACK")
            ray.get(pg.ready())
            groups.append(pg)
        for i, share in enumerate(shares):
            opts = {"num_gpus": share}
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i)
            held.append(Holder.options(**opts).remote())
            got.append(ray.get(held[-1].gpus.remote()))
    out.append(got)
    for a in held:
        ray.kill(a)
    for pg in groups:
        remove_placement_group(pg)
    while ray.available_resources().get("GPU", 0) < 2 - 1e-9:  # all free for the next case
        time.sleep(0.05)
print(json.dumps(out))
"""


@pytest.mark.ray  # a local cluster of its own (tests/conftest.py: the ray tier)
def test_place_gives_each_gpu_share_the_gpu_rays_scheduler_gives_it():
    # the one-GPU vLLM config stretched to two GPUs (replicas, then the trainer's group),
    # and fractions where best fit and first fit part (the third share: GPU 1 or GPU 0)
    stretched = load_config("conf/gsm8k_qwen_1gpu_vllm.yaml", [
        "rollout.min_replicas=2", "rollout.max_replicas=2", "train.num_workers=2"])
    cases = [[d for d in demands(stretched) if d.gpus],
             [Demand(REPLICA, 0, 0.5, 1), Demand(REPLICA, 0, 0.7, 1), Demand(TRAINER, 0, 0.3, 1),
              Demand(TRAINER, 0, 0.5, 1)]]
    steps = [[["pack" if d.role == TRAINER else "actor", [d.gpus] * d.count] for d in case]
             for case in cases]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    out = subprocess.run([sys.executable, "-c", FAKE_GPUS, json.dumps(steps)], env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    ray_gave = json.loads(out.stdout.strip().splitlines()[-1])
    planned = [[list(s.gpus) for s in place(case, cluster_shape(1, 16, 2)).slots] for case in cases]
    assert ray_gave == planned == [[[0], [0], [1], [1]], [[0], [1], [1], [0]]]
