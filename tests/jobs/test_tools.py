"""End to end: conf/tools.yaml, the tool-use task through the real job. Multi-turn
samples (a calc(...) call, the calculator's result appended, a boxed answer) are
generated, rewarded and trained; the held-out evaluation runs the same workflow.
Learning itself is measured by the job's output (README), not asserted here."""

import json

from areal_ray.config import load_config
from areal_ray.run import run_training

STEPS, B, G = 3, 4, 4


def test_tool_task_trains_multi_turn_samples(ray_cluster, tools_model, tmp_path):
    cfg = load_config("conf/tools.yaml", [
        f"model.path={tools_model}", f"train.steps={STEPS}", "algo.eta=1",
        f"algo.batch_groups={B}", f"rollout.group_size={G}", "task.n_eval=16",
        f"run.run_dir={tmp_path / 'run'}",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    summary = run_training(cfg)

    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["n_samples"] == B * G and s["staleness_max"] <= 1
        # every call's result `=N\n` is in the trajectory, out of the loss: >= 3 tokens each
        assert s["tool_tokens"] >= 3 * s["tool_calls"]
        assert 0.0 <= s["tool_use_rate"] <= 1.0
        assert s["n_tokens"] <= B * G * 64  # max_total_tokens bounds each trajectory
    # the warm start calls the tool in a share of its samples: multi-turn samples trained
    assert sum(s["tool_calls"] for s in steps) > 0
    assert sum(s["tool_tokens"] for s in steps) > 0
    assert summary["steps"] == STEPS
    assert 0.0 <= summary["eval_accuracy_before"] <= 1.0
    assert 0.0 <= summary["eval_accuracy_after"] <= 1.0
    assert 0.0 <= summary["eval_tool_use_before"] <= 1.0  # evaluated through the workflow
    assert (tmp_path / "run" / "final_model" / "config.json").exists()
