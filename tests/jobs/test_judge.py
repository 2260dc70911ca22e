"""End to end: conf/judge.yaml, the quickstart rewarded by the served judge (its own
Serve app, deployments/judge.py) through the real job; a judge replica killed mid-run
costs calls, not steps. The same job carries a distillation teacher that no call can
reach in time (tests/jobs/test_distill.py scores with it): every group is late, counted,
and trained on the judge's reward alone. Learning itself is measured by the full demo's run
(docs/benchmarks.md), not asserted here."""

import threading
import time

import ray
from ray import serve

from areal_ray.config import load_config
from areal_ray.observe.tracking import lineage, read_events
from areal_ray.run.job import run_training

STEPS, B, G = 10, 4, 4
JUDGE_REPLICA = "SERVE_REPLICA::areal-judge-"


def judge_replicas() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(JUDGE_REPLICA))


class KillAJudgeReplica(threading.Thread):
    """Once `run_dir`'s step log has `after` steps: the judge's batch sizes so far, then
    ray.kill of its replica, then until Serve runs a new one."""

    def __init__(self, run_dir, after: int):
        super().__init__(daemon=True)
        self.run_dir, self.after = run_dir, after
        self.killed, self.replaced, self.batches, self.error = None, None, [], None

    def run(self):
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                steps = self.run_dir / "steps.jsonl"
                if steps.exists() and len(lineage(read_events(steps))) >= self.after and judge_replicas():
                    break
                time.sleep(0.2)
            (name,) = judge_replicas()
            app = name.removeprefix("SERVE_REPLICA::").split("#")[0]
            self.batches = serve.get_deployment_handle("Judge", app).stats.remote().result(
                timeout_s=30)["batches"]
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            self.killed = name
            while time.monotonic() < deadline and self.replaced is None:
                fresh = [n for n in judge_replicas() if n != name]
                app_status = serve.status().applications.get(app)
                if app_status is None:
                    return  # the job ended (and deleted the app) first
                status = app_status.status
                if fresh and getattr(status, "value", status) == "RUNNING":
                    self.replaced = fresh[0]
                time.sleep(0.2)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_judge_rewarded_run_trains_every_step_through_a_killed_judge_replica(
        ray_cluster, embedded_model, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config("conf/judge.yaml", [
        f"model.path={embedded_model}", f"train.steps={STEPS}", f"algo.batch_groups={B}",
        f"rollout.group_size={G}", "task.n_eval=16", "run.eval_before=false",
        "reward.judge.max_replicas=1", "reward.judge.timeout_s=3", "reward.judge.retries=1",
        f"run.run_dir={run_dir}", f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "algo.distill.enabled=true", f"algo.distill.teacher_path={embedded_model}",
        "algo.distill.num_cpus=0.5", "algo.distill.deadline_s=0.0001", "algo.distill.late=reward"])
    killer = KillAJudgeReplica(run_dir, after=1)
    killer.start()
    summary = run_training(cfg)
    killer.join(timeout=60)
    assert killer.error is None, killer.error
    assert killer.killed and killer.replaced, "Serve did not replace the killed judge replica"
    assert max(killer.batches) > 1  # serve.batch answered several calls with one generation

    recs = lineage(read_events(run_dir / "steps.jsonl"))
    assert summary["steps"] == STEPS and [r["version"] for r in recs] == list(range(1, STEPS + 1))
    assert [t for r in recs for t in r["tickets"]] == list(range(STEPS * B))  # no step, no group lost
    kinds = {}
    for r in recs:
        assert r["n_samples"] == B * G
        # the teacher answered no call in time: each group late, trained on its reward
        assert (r["teacher_scored"], r["teacher_late"], r["teacher_dropped"]) == (0, B, 0)
        assert r["distill_reverse_kl"] is None
        assert sum(r["reward_reasons"].values()) == B * G
        assert set(r["reward_reasons"]) <= {"judge scored", "judge timeout", "judge failed",
                                            "judge unparsed"}
        for k, n in r["reward_reasons"].items():
            kinds[k] = kinds.get(k, 0) + n
    assert kinds["judge scored"] > 0 and any(r["reward_mean"] > 0 for r in recs)
    # the calls the kill cost: reward 0 with the reason, counted, and the run went on
    assert kinds.get("judge timeout", 0) + kinds.get("judge failed", 0) > 0, kinds
    assert 0.0 <= summary["eval_accuracy_after"] <= 1.0  # graded by math (instead_of)
    assert not [a for a in serve.status().applications
                if a.startswith(("areal-judge-", "areal-teacher-"))]  # deleted with the job
