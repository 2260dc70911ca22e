"""Checkpoints end to end: a new job continues a finished run's checkpoint, and a run
stopped by Ctrl-C. Both must give the version sequence of an uninterrupted run with no
prompt trained twice. (A trainer worker killed mid-run, restarted by Ray Train from its
last checkpoint: tests/jobs/test_faults.py, in one run with a killed replica.)"""

import json
import os
import re
import signal
import threading
import time

import mlflow
import pytest
import ray
from ray._private import state

from areal_ray.config import ConfigError, load_config
from areal_ray.observe.tracking import lineage, read_events
from areal_ray.run.interrupt import RunInterrupted
from areal_ray.run.job import run_training
from areal_ray.train.checkpoint import checkpoint_dirs, latest_checkpoint

B, GROUP = 4, 4


def config(embedded_model, run_dir, mlflow_db, *extra):
    return load_config("conf/quickstart.yaml", [
        f"model.path={embedded_model}", f"algo.batch_groups={B}", f"rollout.group_size={GROUP}",
        "rollout.max_new_tokens=48", "task.n_eval=8", "run.eval_before=false",
        "train.checkpoint_every=2", f"run.run_dir={run_dir}",
        f"run.mlflow_tracking_uri=sqlite:///{mlflow_db}", *extra])


def check_lineage(run_dir, steps: int, eta: int) -> list[dict]:
    recs = lineage(read_events(run_dir / "steps.jsonl"))
    assert [r["version"] for r in recs] == list(range(1, steps + 1))
    positions = [p for r in recs for p in r["positions"]]
    assert len(positions) == len(set(positions)) == steps * B  # no prompt trained twice
    tickets = [t for r in recs for t in r["tickets"]]
    assert tickets == list(range(steps * B))  # exactly an uninterrupted run's tickets
    assert all(r["staleness_max"] <= eta for r in recs)  # the bound holds across resume
    return recs


def at_version(run_dir, version: int, act, done: list) -> None:
    """Poll the run's step records; once `version` is trained, `act()` once and note it."""
    path = run_dir / "steps.jsonl"
    while not done:
        if path.exists() and any(r.get("version", 0) >= version for r in read_events(path)):
            done.append(act())
            return
        time.sleep(0.1)


def kill_actor(is_target) -> int:
    """SIGKILL the process of the first live actor whose class name passes `is_target`."""
    for a in state.actors().values():
        if is_target(a["ActorClassName"]) and a["State"] == "ALIVE":
            os.kill(a["Pid"], signal.SIGKILL)
            return a["Pid"]
    raise AssertionError("no such live actor")


def kill_a_train_worker_when(run_dir, version: int, killed: list) -> None:
    at_version(run_dir, version, lambda: kill_actor(lambda name: name == "RayTrainWorker"), killed)


def test_new_job_resumes_a_runs_checkpoint(ray_cluster, embedded_model, tmp_path):
    """The first job is also the suite's synchronous run, as on one shared GPU: eta 0,
    the replica freeing its engine's memory every step, evaluated before and after
    (test_train.check_run)."""
    from tests.jobs.test_train import check_run
    run_dir, db = tmp_path / "run", tmp_path / "mlflow.db"
    first = run_training(config(embedded_model, run_dir, db, "train.steps=2", "algo.eta=0",
                                "rollout.release_memory=true", "run.eval_before=true"))
    check_run(run_dir, db, first, 2, 0, "shm", released=True)
    assert 0.0 <= first["eval_accuracy_before"] <= 1.0
    with pytest.raises(ConfigError, match="run.resume=true"):
        run_training(config(embedded_model, run_dir, db, "train.steps=4", "algo.eta=0"))
    first_config = (run_dir / "config.json").read_text()
    # what the checkpoint's positions mean: refused before Ray is touched, config.json kept
    with pytest.raises(ConfigError, match=r"task.seed: 0 -> 5 .*run.resume_allow_changes=\[task.seed\]"):
        run_training(config(embedded_model, run_dir, db, "train.steps=4", "algo.eta=0",
                            "run.resume=true", "task.seed=5"))
    assert (run_dir / "config.json").read_text() == first_config

    # two FSDP workers now: DCP re-shards the one worker's model and optimizer state
    second = run_training(config(embedded_model, run_dir, db, "train.steps=4", "algo.eta=0",
                                 "run.resume=true", "train.num_workers=2", "run.keep_checkpoints=1"))
    assert (run_dir / "config.json").read_text() == first_config
    assert json.loads((run_dir / "config.resume-1.json").read_text())["train"]["num_workers"] == 2
    # the version-4 checkpoint, sealed once both ranks' parts were stored, pruned the first
    dirs = checkpoint_dirs(run_dir / "train")  # not Ray Train's checkpoint_manager_snapshot.json
    sealed = [d for d in dirs if (d / "complete.json").exists()]
    assert len(dirs) == 2 and sealed == [latest_checkpoint(run_dir / "train")]
    marker = json.loads((sealed[0] / "complete.json").read_text())
    assert marker["version"] == 4 and {"state/__0_0.distcp", "state/__1_0.distcp", "rng_rank1.pt",
                                       "model/model.safetensors"} <= set(marker["files"])
    assert [p.name for p in (set(dirs) - set(sealed)).pop().iterdir()] == ["pruned.json"]
    # what a third job's Ray Train controller does first: check every checkpoint its run
    # snapshot lists is still there (a deleted one would stop the job)
    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    CheckpointManager(CheckpointConfig(), StorageContext(str(run_dir), "train"))
    recs = check_lineage(run_dir, 4, eta=0)
    assert all(r["admitted_versions"] == [r["step"]] * B for r in recs)  # still synchronous
    assert second["steps"] == 4 and second["resumed_at_step"] == 2
    assert second["mlflow_run_id"] == first["mlflow_run_id"]  # one MLflow run per training run
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    history = mlflow.MlflowClient().get_metric_history(second["mlflow_run_id"], "reward_mean")
    assert sorted(int(m.step) for m in history) == [0, 1, 2, 3]


def test_resume_without_a_checkpoint_is_a_clear_error(embedded_model, tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint"):
        run_training(config(embedded_model, tmp_path / "none", tmp_path / "db", "run.resume=true"))


def interrupt_when(run_dir, version: int, sent: list) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the job's process (this one; Ray's own
    processes block SIGINT)."""
    at_version(run_dir, version, lambda: os.kill(os.getpid(), signal.SIGINT) or version, sent)


def dataset_keys(tmp_path, n: int) -> tuple[str, ...]:
    """A training set read from a file: `n` embedded prompts, cycled, a window of 4."""
    from areal_ray.data.prompts import embedded_rows
    rows = embedded_rows(77, n, load_config(None, []).task)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({k: r[k] for k in ("uid", "prompt", "answer")}) + "\n"
                            for r in rows))
    return f"task.train_path={data}", "task.shuffle_window=4"


def kill_the_driver_when(run_dir, version: int, killed: list) -> None:
    at_version(run_dir, version, lambda: kill_actor(lambda name: name == "Driver"), killed)


def test_ctrl_c_and_a_killed_driver_stop_a_dataset_run_that_resumes_its_stream_exactly(
        ray_cluster, embedded_model, tmp_path):
    """One run, stopped twice and resumed twice; its prompts come from a file (5 prompts
    cycled, a window of 4: every checkpoint falls mid-epoch), and each resumed job skips
    what its checkpoint consumed where the stream reads it.
    1. Ctrl-C stops the first job at a step, with a checkpoint of its own.
    2. The second job resumes it (now checkpointing every 2 steps); its driver actor is
       killed: the job fails fast, naming the resume, and leaves no placement group
       holding the shared cluster's CPUs.
    3. The third job resumes from the last checkpoint and trains to its end: every
       version once (the steps after the checkpoint again), each prompt once per epoch."""
    run_dir, db, steps, n, eta = tmp_path / "run", tmp_path / "mlflow.db", 40, 5, 1
    keys = dataset_keys(tmp_path, n)
    sent: list = []
    threading.Thread(target=interrupt_when, args=(run_dir, 2, sent), daemon=True).start()
    # checkpoints every 40 steps: the one the interrupted run leaves is Ctrl-C's own
    with pytest.raises(RunInterrupted, match=r"stopped after version (\d+): checkpoint at version"):
        run_training(config(embedded_model, run_dir, db, f"train.steps={steps}", f"algo.eta={eta}",
                            f"train.checkpoint_every={steps}", *keys))
    assert sent
    stopped = json.loads((latest_checkpoint(run_dir / "train") / "trainer_state.json").read_text())
    recorded = lineage(read_events(run_dir / "steps.jsonl"))
    assert 2 <= stopped["version"] < steps and recorded[-1]["version"] == stopped["version"]

    # three versions on: one of the first two is even, and its checkpoint is complete
    # before the third version's record (the loop saves, then steps on)
    killed: list = []
    threading.Thread(target=kill_the_driver_when, args=(run_dir, stopped["version"] + 3, killed),
                     daemon=True).start()
    t0 = time.time()
    with pytest.raises(RuntimeError, match="driver actor .* died.* run.resume=true"):
        run_training(config(embedded_model, run_dir, db, f"train.steps={steps}", f"algo.eta={eta}",
                            "train.checkpoint_every=2", "train.max_failures=2", "run.resume=true",
                            *keys))
    assert killed and time.time() - t0 < 300
    # nothing of the failed job keeps CPUs reserved: a placement group left behind had
    # starved a later run of this shared cluster (its reward actor was never placed)
    deadline = time.time() + 30
    while any(pg["state"] == "CREATED" for pg in ray.util.placement_group_table().values()):
        assert time.time() < deadline, ray.util.placement_group_table()
        time.sleep(0.5)
    ckpt = json.loads((latest_checkpoint(run_dir / "train") / "trainer_state.json").read_text())
    assert ckpt["version"] > stopped["version"] and ckpt["version"] % 2 == 0

    total = ckpt["version"] + 2
    resumed = run_training(config(embedded_model, run_dir, db, f"train.steps={total}",
                                  f"algo.eta={eta}", "train.checkpoint_every=2", "run.resume=true",
                                  *keys))
    assert resumed["resumed_at_step"] == ckpt["version"]
    positions = [p for r in check_lineage(run_dir, total, eta=eta) for p in r["positions"]]
    by_epoch = {}
    for p in positions:
        by_epoch.setdefault(p // n, []).append(p % n)
    full, rest = divmod(total * B, n)
    for epoch in range(full):
        assert sorted(by_epoch[epoch]) == list(range(n))  # full epochs
    assert len(by_epoch.get(full, [])) == rest and len(set(by_epoch.get(full, []))) == rest
    assert len(by_epoch) == full + (rest > 0)


def test_the_job_exits_130_with_one_line_on_ctrl_c(capsys):
    from jobs.cli import run_job

    def interrupted(cfg):
        raise RunInterrupted("stopped after version 3: checkpoint at version 3 in x")

    assert run_job([], "prog", "desc", interrupted) == 130
    # Ray's log monitor streams other processes' lines ("(Actor pid=N) ...") to this
    # process's stderr whenever they come, from tests before this one: not ours.
    err = [line for line in capsys.readouterr().err.splitlines(keepends=True)
           if not re.match(r"(\x1b\[\d+m)?\(\w+ pid=\d+", line)]
    assert err == ["interrupted: stopped after version 3: checkpoint at version 3 in x\n"]
