"""MLflow set-up: a sqlite store given by a relative path works (artifacts next to it)."""

from pathlib import Path

import mlflow
import pytest

from areal_ray.config import load_config
from areal_ray.observe.tracking import unseen_records, use_experiment


def test_a_relative_sqlite_store_gets_an_absolute_artifact_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.mlflow_tracking_uri=sqlite:///stores/mlflow.db",
                             "run.mlflow_experiment=relative-store"])
    (tmp_path / "stores").mkdir()
    use_experiment(cfg)
    exp = mlflow.get_experiment_by_name("relative-store")
    assert exp.artifact_location == (tmp_path / "stores" / "artifacts").as_uri()
    assert Path(tmp_path / "stores" / "mlflow.db").exists()


def rec(v: int) -> dict:
    return {"version": v, "step": v - 1}


def restore(v: int, *kept: int) -> dict:
    return {"event": "restore", "version": v, "records": [rec(k) for k in kept]}


@pytest.mark.parametrize("events, event, unseen", [
    # the driver died after the trainer checkpointed v4 and before the job read its record
    ([rec(1), rec(2), rec(3)], restore(4, 3, 4), [4]),
    # the job read everything: nothing is replayed
    ([rec(1), rec(2), rec(3), rec(4)], restore(4, 3, 4), []),
    # a trainer restart inside a run: the records after the checkpoint are rolled back,
    # not replayed, and those before it were seen
    ([rec(1), rec(2), rec(3), rec(4), rec(5)], restore(4, 3, 4), []),
    # a restore rolled the log back to v2 earlier; v3 and v4 are unseen since
    ([rec(1), rec(2), rec(3), restore(2), ], restore(4, 3, 4), [3, 4]),
    # a checkpoint written before checkpoints kept records
    ([rec(1)], {"event": "restore", "version": 2}, []),
    ([], restore(0), []),
])
def test_a_restore_replays_only_the_records_the_job_never_read(events, event, unseen):
    assert [r["version"] for r in unseen_records(events, event)] == unseen
