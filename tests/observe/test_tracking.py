"""MLflow set-up: a sqlite store given by a relative path works (artifacts next to it)."""

from pathlib import Path

import mlflow

from areal_ray.config import load_config
from areal_ray.observe.tracking import use_experiment


def test_a_relative_sqlite_store_gets_an_absolute_artifact_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run.mlflow_tracking_uri=sqlite:///stores/mlflow.db",
                             "run.mlflow_experiment=relative-store"])
    (tmp_path / "stores").mkdir()
    use_experiment(cfg)
    exp = mlflow.get_experiment_by_name("relative-store")
    assert exp.artifact_location == (tmp_path / "stores" / "artifacts").as_uri()
    assert Path(tmp_path / "stores" / "mlflow.db").exists()
