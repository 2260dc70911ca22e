"""End to end: conf/tools.yaml, the tool-use task through the real job. Multi-turn
samples (a calc(...) call, the calculator's result appended, a boxed answer) are
generated, rewarded and trained; the held-out evaluation runs the same workflow.
Learning itself is measured by the job's output (docs/benchmarks.md), not asserted here."""

import json

from areal_ray.config import load_config
from areal_ray.observe.tracking import lineage, read_events
from areal_ray.run.job import run_training

STEPS, B, G = 3, 4, 4


def test_tool_task_trains_multi_turn_samples_on_vllm_synchronously(ray_cluster, tools_model,
                                                                   tmp_path):
    """vLLM stops at the call's `)` (stop token ids); eta 0 is synchronous. (The hf engine
    with eta 2 and rolling updates: the resume test below.)"""
    cfg = load_config("conf/tools.yaml", [
        f"model.path={tools_model}", f"train.steps={STEPS}", "algo.eta=0", "rollout.backend=vllm",
        f"algo.batch_groups={B}", f"rollout.group_size={G}", "task.n_eval=16",
        f"run.run_dir={tmp_path / 'run'}",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    summary = run_training(cfg)

    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        assert s["n_samples"] == B * G and s["staleness_max"] == 0
        assert s["admitted_versions"] == [s["step"]] * B
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


def tools_config(model, run_dir, *extra):
    return load_config("conf/tools.yaml", [
        f"model.path={model}", f"algo.batch_groups={B}", f"rollout.group_size={G}",
        "task.n_eval=8", "run.eval_before=false", f"run.run_dir={run_dir}",
        f"run.mlflow_tracking_uri=sqlite:///{run_dir.parent / 'mlflow.db'}", *extra])


def multi_turn_steps(run_dir, eta: int) -> list[dict]:
    recs = lineage(read_events(run_dir / "steps.jsonl"))
    assert all(r["staleness_max"] <= eta for r in recs)
    assert sum(r["tool_calls"] for r in recs) > 0 and sum(r["tool_tokens"] for r in recs) > 0
    return recs


ROLLING = ["rollout.min_replicas=2", "rollout.max_replicas=2", "rollout.rolling_update=true",
           "algo.eta=2", "train.checkpoint_every=2", "run.eval_after=false"]


def test_tool_task_with_rolling_updates_resumes_from_a_checkpoint(ray_cluster, tools_model,
                                                                  tmp_path):
    """Two replicas swap weights one at a time under running episodes; a new job resumes
    the run from its checkpoint."""
    run_dir = tmp_path / "run"
    run_training(tools_config(tools_model, run_dir, "train.steps=2", *ROLLING))
    resumed = run_training(tools_config(tools_model, run_dir, "train.steps=4", "run.resume=true",
                                        *ROLLING))
    assert resumed["resumed_at_step"] == 2
    recs = multi_turn_steps(run_dir, eta=2)
    assert [r["version"] for r in recs] == [1, 2, 3, 4]
    positions = [p for r in recs for p in r["positions"]]
    assert len(positions) == len(set(positions)) == 4 * B  # no prompt trained twice
