"""Operations end to end: `ray job submit` of the training job to a cluster started
with `ray start --head`; while it runs, its live metrics are read from the cluster's
Prometheus endpoint; when it ends, its MLflow run (params, step metrics, curves, the
final model in HF format, the registered version) and its progress lines."""

import json
import re
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import mlflow
from ray.job_submission import JobStatus, JobSubmissionClient
from transformers import AutoModelForCausalLM

from areal_ray.observe.metrics import METRICS

STEPS = 8
LINE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)$")


def scrape(url: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every areal sample on the endpoint."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [(m[1], m[2], float(m[3])) for m in map(LINE.match, text.splitlines())
            if m and m[1].startswith("ray_areal_")]


def ray_job(cluster: dict, command: str, *args: str) -> str:
    """The `ray job` CLI, as a user runs it (token mode: it sends ~/.ray/auth_token)."""
    out = subprocess.run(["ray", "job", command, "--address", cluster["dashboard_url"], *args],
                         env=cluster["env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def test_submitted_job_reports_metrics_mlflow_and_progress(head_cluster, tmp_path):
    name = f"submit-{uuid.uuid4().hex[:6]}"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    out = ray_job(
        head_cluster, "submit", "--working-dir", ".", "--no-wait", "--",
        "python", "-m", "jobs.train", "--config", "conf/quickstart.yaml",
         f"train.steps={STEPS}", "algo.batch_groups=4", "rollout.group_size=4", "task.n_eval=16",
         "run.eval_before=false", f"run.name={name}", f"run.run_dir={run_dir}",
         f"run.mlflow_tracking_uri={store}", f"run.register_model={name}-policy")
    job_id = re.search(r"Job '([^']+)' submitted successfully", out)[1]

    # The SDK (as a notebook would use it) sends the cluster's token explicitly.
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    client = JobSubmissionClient(head_cluster["dashboard_url"],
                                 headers={"Authorization": f"Bearer {token}"})
    seen: dict[str, list[tuple[str, float]]] = {}
    deadline = time.time() + 480
    while not (status := client.get_job_status(job_id)).is_terminal():
        assert time.time() < deadline, "the job did not finish in time"
        for n, labels, value in scrape(head_cluster["metrics_url"]):
            if f'run="{name}"' in labels:
                seen.setdefault(n, []).append((labels, value))
        time.sleep(2)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]

    # Every documented metric was exported under its Prometheus name, for this run.
    for metric, (kind, _, _) in METRICS.items():
        names = {f"ray_{metric}"} | ({f"ray_{metric}_total"} if kind == "counter" else set()) \
            | ({f"ray_{metric}_{s}" for s in ("bucket", "count", "sum")} if kind == "histogram" else set())
        assert names & seen.keys(), f"{metric} never appeared on the metrics endpoint"
    assert max(v for _, v in seen["ray_areal_version"]) >= 1
    assert {v for _, v in seen["ray_areal_rollout_replicas"]} <= {0.0, 1.0}
    assert max(v for _, v in seen["ray_areal_reward_pool_actors"]) >= 1
    phases = {re.search(r'phase="(\w+)"', lbl)[1] for lbl, _ in seen["ray_areal_weight_push_seconds"]}
    assert phases == {"gather", "transfer", "load", "total"}
    assert {re.search(r'state="(\w+)"', lbl)[1] for lbl, _ in seen["ray_areal_rollout_requests"]} \
        == {"running", "queued"}

    # One progress line per step and a final summary, in the job's logs.
    assert len(re.findall(rf"\[areal-ray\] step +\d+/{STEPS} v", logs)) == STEPS
    assert "[areal-ray] done:" in logs

    # The MLflow run: resolved config, step metrics, curves, the model, its registration.
    summary = json.loads((run_dir / "summary.json").read_text())
    mc = mlflow.MlflowClient(tracking_uri=store)
    run = mc.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == name
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["algo.eta"] == "2"
    assert len(mc.get_metric_history(run.info.run_id, "reward_mean")) == STEPS
    arts = {a.path for a in mc.list_artifacts(run.info.run_id)}
    assert {"curves.png", "steps.jsonl", "summary.json", "model"} <= arts
    model_dir = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="model", dst_path=str(tmp_path / "dl"),
        tracking_uri=store)
    assert AutoModelForCausalLM.from_pretrained(model_dir).config.model_type == "qwen2"
    version = mc.get_model_version(f"{name}-policy", summary["registered_model"].split("/")[1])
    assert version.run_id == run.info.run_id
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
