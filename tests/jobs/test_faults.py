"""Faults a cluster does to a run, injected into the real job: the run goes on. (A
killed driver actor, which ends the job for a resume: tests/jobs/test_resume.py.)"""

import json
import threading

from areal_ray.observe.tracking import read_events
from areal_ray.run.job import run_training
from areal_ray.train.checkpoint import latest_checkpoint
from tests.jobs.test_resume import (
    GROUP,
    B,
    at_version,
    check_lineage,
    config,
    kill_a_train_worker_when,
    kill_actor,
)


def kill_the_rollout_replica_when(run_dir, version: int, killed: list) -> None:
    at_version(run_dir, version, lambda: kill_actor(lambda name: name.startswith("ServeReplica:")),
               killed)


def test_a_killed_replica_is_invisible_and_a_killed_trainer_restarts_from_its_checkpoint(
        ray_cluster, embedded_model, tmp_path):
    """Two faults in one run (one replica, one trainer restart allowed). The replica,
    killed after version 2: groups in flight on it are retried on its replacement, the
    driver drops it at once instead of waiting a push timeout for it, and the trainer
    never restarts for it. A trainer worker, killed after version 5: Ray Train restarts
    it from the last checkpoint (4 or 6) and the run goes on from there. Either way the
    versions, tickets and prompts are an uninterrupted run's, each exactly once."""
    run_dir, steps, eta = tmp_path / "run", 8, 1
    cfg = config(embedded_model, run_dir, tmp_path / "mlflow.db", f"train.steps={steps}",
                 f"algo.eta={eta}", "train.checkpoint_every=2", "train.max_failures=1",
                 "run.push_timeout_s=600", "run.eval_after=false")
    replica: list = []
    trainer: list = []
    threading.Thread(target=kill_the_rollout_replica_when, args=(run_dir, 2, replica), daemon=True).start()
    threading.Thread(target=kill_a_train_worker_when, args=(run_dir, 5, trainer), daemon=True).start()
    summary = run_training(cfg)
    assert replica, "the run finished before the replica could be killed"
    assert trainer, "the run finished before the trainer could be killed"

    events = read_events(run_dir / "steps.jsonl")
    restores = [e for e in events if e.get("event") == "restore"]
    # one restart, the trainer's: one for the replica would restore version 2
    assert len(restores) == 1 and restores[0]["version"] in (4, 6), restores
    after = events[events.index(restores[0]) + 1]
    assert after["version"] == restores[0]["version"] + 1  # training went on from there
    recs = check_lineage(run_dir, steps, eta)  # versions, tickets and prompts exactly once
    # no push waited for the dead replica (its timeout is 600 s here)
    assert max(r["push_total_s"] for r in recs) < 60, [r["push_total_s"] for r in recs]
    assert all(r["n_samples"] == B * GROUP for r in recs)
    assert summary["steps"] == steps and summary["max_staleness"] <= eta
    latest = latest_checkpoint(run_dir / "train")
    assert json.loads((latest / "trainer_state.json").read_text())["version"] == steps
    for name in ("model/config.json", "model/model.safetensors", "state/.metadata",
                 "state/__0_0.distcp", "scheduler.pt", "rng_rank0.pt"):
        assert (latest / name).exists(), name
