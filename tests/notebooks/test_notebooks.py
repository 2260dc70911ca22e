"""Both notebooks run top to bottom on the tiny model, attached to a cluster started
with `ray start --head` (as a user's would be), so they never rot."""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, env: dict, monkeypatch) -> nbformat.NotebookNode:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def outputs(nb) -> str:
    return "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.fixture
def nb_env(head_cluster, tmp_path):
    return {"RAY_ADDRESS": head_cluster["gcs_address"],
            "AREAL_NB_OVERRIDES": " ".join([
                "train.steps=4", "task.n_eval=8", "rollout.max_new_tokens=64",
                "reward.max_actors=1",  # as tests/jobs/test_resume.py's runs
                f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])}


def test_quickstart_notebook(nb_env, monkeypatch, tmp_path):
    nb = execute("01_quickstart.ipynb", nb_env, monkeypatch)
    text = outputs(nb)
    port = nb_env["RAY_ADDRESS"].rsplit(":", 1)[1]
    assert re.search(rf"attached to the cluster at [\d.]+:{port}\b", text), text[:2000]
    assert "reward curve: 4 points" in text
    assert "'curves.png'" in text and "'model'" in text
    assert "sampled_pass@4" in text
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))


def test_staleness_notebook(nb_env, monkeypatch):
    """One eta: every cell runs (the table, its in-notebook bound check, the plot) on one
    run. Two jobs in one kernel are the quickstart notebook's (training, then eval); each
    eta's bound is a job's check (tests/jobs/test_train.py names which)."""
    nb = execute("02_staleness.ipynb", {**nb_env, "AREAL_NB_ETAS": "2"}, monkeypatch)
    assert "compared 1 runs at eta [2]" in outputs(nb)
