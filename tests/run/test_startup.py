"""The order a job starts its parts in (areal_ray/run/startup.py): the rule, and a job
whose replicas never run while its trainer started beside them."""

import time

import pytest
import ray

from areal_ray.cluster.placement import PlacementError
from areal_ray.config import load_config
from areal_ray.run.job import run_training
from areal_ray.run.startup import sequential_start

# (overrides, whether the trainer waits for the replicas)
RULES = [
    ([], False),
    (["run.overlap_start=false"], True),
    (["train.use_gpu=true", "train.num_gpus_per_worker=1", "rollout.num_gpus=1"], False),
    (["train.use_gpu=true", "train.num_gpus_per_worker=0.5", "rollout.num_gpus=0.5"], True),
    (["train.use_gpu=true", "train.num_gpus_per_worker=1", "rollout.num_gpus=0.5"], True),
    (["train.use_gpu=false", "rollout.num_gpus=0.5"], False),  # replicas share, the trainer does not
]


@pytest.mark.parametrize("overrides,waits", RULES)
def test_the_trainer_waits_only_where_it_could_change_what_an_engine_measures(overrides, waits):
    why = sequential_start(load_config("conf/quickstart.yaml", overrides))
    assert (why is not None) == waits, why


def test_replicas_that_never_run_fail_the_job_and_take_the_trainer_started_beside_them(
        ray_cluster, embedded_model, tmp_path):
    cfg = load_config("conf/quickstart.yaml", [
        f"model.path={embedded_model}", "train.steps=2", "algo.batch_groups=2",
        "rollout.group_size=2", "task.n_eval=4",
        # a replica that needs a GPU on a CPU cluster is never placed
        "rollout.num_gpus=1", "run.check_placement=false", "run.placement_timeout_s=8",
        f"run.run_dir={tmp_path / 'run'}",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    with pytest.raises(PlacementError, match=r"rollout app .* not running after "
                                             r"run.placement_timeout_s=8"):
        run_training(cfg)
    from ray.util.state import list_actors
    dashboard = ray.get_runtime_context().runtime_env["env_vars"]["RAY_API_SERVER_ADDRESS"]

    # The job returns once the controller is gone; its workers end with it, a moment
    # later (Ray kills an actor's owned actors and placement group after the owner):
    # under a loaded full suite that moment was longer than the next line took.
    trainer, deadline = {"TrainController", "RayTrainWorker", "Driver"}, time.monotonic() + 30
    while True:
        alive = {a.class_name for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")])}
        if not trainer & alive or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not trainer & alive, alive
    # the trainer's worker group had started, and on a local cluster (the one a job
    # starts, local_worker_env) Ray Train starts no preemption watcher beside it
    ever = {a.class_name for a in list_actors(address=dashboard, limit=10_000)}
    assert "RayTrainWorker" in ever and "PreemptionWatcher" not in ever, ever
