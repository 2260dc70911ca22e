"""End to end: `jobs.sft` on the embedded arith data through Ray Train. The held-out
completion loss falls; a second job resumes the first's checkpoint; the final model
loads and is a start `jobs.train` accepts; bad input is exit status 2 naming the row."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import ConfigError, load_config
from areal_ray.run.job import resolve_model
from areal_ray.sft.job import read_records, run_sft
from areal_ray.train.checkpoint import checkpoint_dirs
from jobs import sft as sft_job


def test_sft_lowers_the_loss_resumes_and_leaves_a_model_rl_starts_from(ray_cluster, embedded_model,
                                                                      tmp_path, capsys):
    run_dir = tmp_path / "sft"
    base = [f"model.path={embedded_model}", "sft.n_train=64", "sft.n_eval=32", "sft.batch_size=16",
            "sft.accuracy_n=0", "train.checkpoint_every=2", f"run.run_dir={run_dir}",
            f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    first = run_sft(load_config("conf/sft.yaml", [*base, "train.steps=2"]))
    assert first["steps"] == 2 and first["eval_loss_after"] < first["eval_loss_before"]
    assert checkpoint_dirs(run_dir / "train")
    with pytest.raises(ConfigError, match="already holds another run's outputs"):
        run_sft(load_config("conf/sft.yaml", [*base, "train.steps=4"]))

    second = run_sft(load_config("conf/sft.yaml", [*base, "train.steps=4", "run.resume=true"]))
    steps = [r for r in read_records(run_dir) if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]  # 2 and 3 by the resumed job
    assert second["eval_loss_after"] < first["eval_loss_before"]
    assert "trainer starts at step 2 (from checkpoint" in capsys.readouterr().out
    # one MLflow run for both jobs: every step's loss, by step, and the final model
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    # the resumed job's config beside the first's, which stays as it was
    assert json.loads((run_dir / "config.json").read_text())["train"]["steps"] == 2
    assert json.loads((run_dir / "config.resume-1.json").read_text())["train"]["steps"] == 4
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(int(m.step) for m in client.get_metric_history(first["mlflow_run_id"], "loss")) == [0, 1, 2, 3]
    assert client.get_run(first["mlflow_run_id"]).info.status == "FINISHED"
    assert "model" in {a.path for a in client.list_artifacts(first["mlflow_run_id"])}

    final = run_dir / "final_model"
    tuned = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(embedded_model, dtype=torch.float32).state_dict()
    assert any(not torch.equal(tuned[k], start[k]) for k in start)
    rl = load_config("conf/quickstart.yaml", [f"model.path={final}"])
    assert resolve_model(rl.model.path) == str(final)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n" + json.dumps({"prompt": "1+1="}) + "\n")
    assert sft_job.main(["--config", "conf/sft.yaml", f"sft.train_path={bad}",
                         f"run.run_dir={tmp_path / 'bad'}"]) == 2
    assert f"{bad}:2: the row has no 'completion'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
