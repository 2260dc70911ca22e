"""Run outputs: steps.jsonl, summary.json and MLflow (the console's view is progress.py).

All of it happens in the job's own process: workers only send step records to the
driver actor, which the job tails. That keeps file and MLflow I/O off the training
workers and makes the run directory correct even when workers run on other nodes.

MLflow's default here is a sqlite store under ./mlruns (the plain file store is in
maintenance mode in MLflow 3); any tracking URI (an MLflow server) can be set.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric

from areal_ray.config import Config, to_dict
from areal_ray.observe.plots import plot_curves
from areal_ray.run.resume import write_config_record


def default_tracking_uri(root: str | Path = "mlruns") -> str:
    root = Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def use_experiment(cfg: Config) -> str:
    """Point mlflow at the run's tracking URI and experiment (created on first use,
    with its artifacts next to a sqlite store rather than in the working dir)."""
    uri = cfg.run.mlflow_tracking_uri or default_tracking_uri()
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(cfg.run.mlflow_experiment) is None:
        artifacts = None
        if uri.startswith("sqlite:"):
            # sqlite:///rel.db is relative to the working dir; a file URI must be absolute
            artifacts = (Path(uri[len("sqlite:///"):]).absolute().parent / "artifacts").as_uri()
        mlflow.create_experiment(cfg.run.mlflow_experiment, artifact_location=artifacts)
    mlflow.set_experiment(cfg.run.mlflow_experiment)
    return uri


def params_of(cfg: Config) -> dict:
    """The resolved config as flat MLflow params (`algo.eta` -> "2")."""
    return {k: str(v)[:6000] for k, v in _flatten(to_dict(cfg)).items()}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def lineage(events: list[dict]) -> list[dict]:
    """The step records that survive: a restore to version v discards the records of
    later versions (their training was lost with the trainer that did it)."""
    out: list[dict] = []
    for e in events:
        if e.get("event") == "restore":
            out = [r for r in out if r["version"] <= e["version"]]
        else:
            out.append(e)
    return out


def unseen_records(events: list[dict], restore: dict) -> list[dict]:
    """The step records a restore event carries (its checkpoint's, train/checkpoint.py)
    that `events` lack: those of versions after the last surviving record, up to the
    restored version. A job whose driver died before it read them gets them here."""
    known = max((r["version"] for r in lineage(events)), default=0)
    return [r for r in restore.get("records", ()) if known < r["version"] <= restore["version"]]


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def open_run(cfg: Config, run_dir: Path, resume: bool):
    """(the run's MLflow run, now active; the tracking URI). A resumed run continues the
    MLflow run whose id its run dir keeps; a new one logs the config as params."""
    uri = use_experiment(cfg)
    id_file = run_dir / "mlflow_run_id"
    if resume and id_file.exists():  # params are immutable in MLflow: keep the first ones
        run = mlflow.start_run(run_id=id_file.read_text().strip())
        mlflow.set_tag("resumed", "true")
    else:
        run = mlflow.start_run(run_name=cfg.run.name)
        mlflow.log_params(params_of(cfg))
        id_file.write_text(run.info.run_id)
    mlflow.set_tag("run_dir", str(run_dir))
    return run, uri


def numbers(record: dict, skip: tuple = ()) -> dict[str, float]:
    """A record's numeric values (not bools, not `skip`), as MLflow metrics take them."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in skip}


class RunTracker:
    """steps.jsonl is the run's log: step records, and a restore marker each time the
    trainer restarts from a checkpoint (steps after it may appear twice; `lineage`
    gives the surviving ones). A resumed run appends to it and to the same MLflow run,
    and keeps its config next to the earlier jobs' (areal_ray/run/resume.py)."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False):
        self.cfg = cfg
        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.steps_path = run_dir / "steps.jsonl"
        if not resume:
            self.steps_path.write_text("")
        self.config_path = write_config_record(run_dir, to_dict(cfg), resume)
        self.run, uri = open_run(cfg, run_dir, resume)
        # Step metrics arrive on the tailing thread, where mlflow's (thread-local) active
        # run is not set: log through a client with the explicit run id.
        self.client = mlflow.MlflowClient(tracking_uri=uri)

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def log_restore(self, event: dict) -> None:
        with self.steps_path.open("a") as f:
            f.write(json.dumps(event) + "\n")

    def log_step(self, rec: dict) -> None:
        with self.steps_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, now, int(rec["step"])) for k, v in numbers(rec, ("step", "t_wall")).items()])

    def finish(self, summary: dict, steps: list[dict], model_dir: Path | None = None) -> None:
        """summary.json, the curves PNG, the run's files and the final model (HF format,
        under the artifact path `model`; registered when `run.register_model` names it)."""
        if steps:
            summary["curves_png"] = str(plot_curves(steps, self.run_dir / "curves.png",
                                                    title=f"{self.cfg.run.name} (eta {self.cfg.algo.eta})"))
        if model_dir is not None and self.cfg.run.log_model:
            mlflow.log_artifacts(str(model_dir), artifact_path="model")
            if self.cfg.run.register_model:
                summary["registered_model"] = self.register()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        mlflow.log_metrics(numbers(summary))
        for p in dict.fromkeys([self.steps_path, self.run_dir / "summary.json",
                                self.run_dir / "config.json", self.config_path,
                                self.run_dir / "curves.png"]):
            if os.path.exists(p):
                mlflow.log_artifact(str(p))
        mlflow.end_run()

    def register(self) -> str:
        """Register the logged model as a new version of `run.register_model`
        ("name/version"). The version points at the run's `model` artifacts: plain HF
        files that `AutoModelForCausalLM.from_pretrained` loads once downloaded."""
        name = self.cfg.run.register_model
        try:
            self.client.get_registered_model(name)
        except mlflow.exceptions.MlflowException:
            self.client.create_registered_model(name, description="areal-ray policy (HF format)")
        mv = self.client.create_model_version(name, f"{self.run.info.artifact_uri}/model",
                                              run_id=self.run_id)
        return f"{name}/{mv.version}"

    def fail(self) -> None:
        mlflow.end_run(status="FAILED")
