"""Placement against a real local Ray cluster (areal_ray/cluster/placement.py): an
impossible run is refused before anything is deployed, and every wait for placement
(Serve replicas, Ray Train workers) ends at the deadline with a message naming what
could not be placed, instead of waiting forever."""

import pytest

from areal_ray.cluster.placement import (
    PlacementError,
    bound_train_start,
    check_placement,
    cluster_nodes,
    delete_app,
    deploy_app,
    train_start_problem,
)
from areal_ray.config import load_config
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
