"""End to end: on-policy distillation through the real job. A teacher Serve app scores
every trained group's sampled tokens; a teacher that cannot answer within its
deadline costs its groups (counted, trained on the task reward alone), never the run:
that case rides on tests/jobs/test_judge.py's job.
The teacher here is the student's own warm start (what is tested is the service path;
benchmarks/bench_distill.py measures learning from the RL-trained teacher)."""

import math

from ray import serve

from areal_ray.config import load_config
from areal_ray.observe.tracking import lineage, read_events
from areal_ray.run.job import run_training

STEPS, B, G = 2, 2, 4


def distill_config(model, run_dir, *extra):
    return load_config("conf/distill.yaml", [
        f"model.path={model}", f"algo.distill.teacher_path={model}", "algo.distill.num_cpus=0.5",
        f"train.steps={STEPS}", f"algo.batch_groups={B}", f"rollout.group_size={G}",
        "rollout.max_new_tokens=24", "run.eval_before=false", "run.eval_after=false",
        "run.log_model=false", f"run.run_dir={run_dir}",
        f"run.mlflow_tracking_uri=sqlite:///{run_dir.parent / 'mlflow.db'}", *extra])


def test_a_distillation_run_records_the_teachers_scores(
        ray_cluster, embedded_model, tmp_path):
    summary = run_training(distill_config(embedded_model, tmp_path / "scored"))
    assert summary["steps"] == STEPS
    recs = lineage(read_events(tmp_path / "scored" / "steps.jsonl"))
    for r in recs:
        assert (r["teacher_scored"], r["teacher_late"], r["teacher_dropped"]) == (B, 0, 0)
        # teacher = the student's weights at version 0: the reverse KL starts near 0
        assert math.isfinite(r["distill_reverse_kl"]) and r["teacher_logprob_mean"] < 0
        assert r["teacher_s_mean"] > 0
    assert abs(recs[0]["distill_reverse_kl"]) < 0.05
    assert not any(a.startswith("areal-teacher-") for a in serve.status().applications)  # torn down

