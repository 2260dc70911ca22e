"""A simulated two-node cluster running the real quickstart job: a `ray start` head
that offers `training` and a second raylet on this machine (`ray start --address`, a
node of its own to Ray: its own node id and resources, the head's IP) that offers
`inference`. Two jobs, one run:

1. Rollout pinned to the inference node (`rollout.resources`), the trainer to the head
   (`train.resources`): each lands there (node ids from Ray's state API); every push
   takes the collective path, since the replica's node id is not the trainer's, though
   both nodes have one IP; a checkpoint is written.
   The run's own actors (the driver, Ray Data's stages) are on the job's node, the head.
2. The run resumed from that checkpoint, rollout unpinned on two replicas (Serve
   spreads them: one per node): it restores that version, and pushes to the pair still
   take the collective path. Then the second node is lost: every process of its raylet
   SIGKILLed after a push to the pair. The run finishes every step on the head's
   replica, the loss counted in the step records (`replicas_lost`), and nothing of the
   job is left alive after it.

The raylets are stopped in a `finally`, with the jobs."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from areal_ray.cluster.head import SLOW_MACHINE_ENV, join_node, start_head
from areal_ray.observe.tracking import lineage, read_events
from areal_ray.train.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[2]
FIRST, TOTAL = 4, 10  # versions of the first job; of the run, once resumed
ROLES = {"replica": "ServeReplica:areal-rollout-", "trainer": "RayTrainWorker",
         "driver": "Driver", "stage": "_MapWorker"}  # role: actor class name prefix


class StateView:
    """Ray's state API of the head's dashboard, read over HTTP with the cluster's token
    (the test process holds a Ray of its own in the suite: it must not attach)."""

    def __init__(self, dashboard_url: str):
        self.url = dashboard_url
        self.token = (Path.home() / ".ray" / "auth_token").read_text().strip()

    def _list(self, what: str) -> list[dict]:
        # detail: an actor's repr_name, which tells Ray Data's stages apart (MapWorker(...))
        req = urllib.request.Request(f"{self.url}/api/v0/{what}?limit=10000&timeout=30&detail=true",
                                     headers={"Authorization": f"Bearer {self.token}"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["data"]["result"]["result"]

    def nodes(self) -> list[dict]:
        return self._list("nodes")

    def alive(self) -> dict[str, list[dict]]:
        """{role (ROLES): its live actors}."""
        alive = [a for a in self._list("actors") if a["state"] == "ALIVE"]
        out = {role: [a for a in alive if a["class_name"].startswith(prefix)]
               for role, prefix in ROLES.items()}
        # the reward pool only prefers the job's node (cluster/home.py): not a pinned stage
        out["stage"] = [a for a in out["stage"] if "RewardStage" not in (a.get("repr_name") or "")]
        return out

    def placed(self) -> dict[str, list[str]]:
        """{role: node ids of its live actors}."""
        return {role: sorted(a["node_id"] for a in actors) for role, actors in self.alive().items()}


def start_job(head, tmp_path: Path, log: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jobs.train", "--config", "conf/quickstart.yaml",
         "algo.batch_groups=2", "rollout.group_size=4", "rollout.max_new_tokens=32",
         "reward.max_actors=1", "run.eval_before=false", "run.eval_after=false", "run.log_model=false",
         "train.checkpoint_every=2", "train.resources={training: 1}", "run.name=two-nodes",
         f"run.run_dir={tmp_path / 'run'}", f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
         f"run.ray_address={head.gcs_address}", *overrides],
        cwd=REPO, env=dict(head.env, PYTHONUNBUFFERED="1"), stdout=log.open("w"),
        stderr=subprocess.STDOUT, start_new_session=True)


def steps_of(run_dir: Path, skip: int = 0) -> list[dict]:
    path = run_dir / "steps.jsonl"
    return [e for e in read_events(path)[skip:] if "version" in e and "event" not in e] \
        if path.exists() else []


def test_roles_weights_checkpoints_and_resume_on_two_raylets(embedded_model, tmp_path):
    head = start_head(tmp_path / "head.log", num_cpus=4, args=("--resources", '{"training": 1}'), tries=4,
                      # a dead node is noticed in ~3 s, not Ray's ~15 s
                      extra_env={"RAY_health_check_period_ms": "1000", **SLOW_MACHINE_ENV})
    node = job = None
    try:
        node = join_node(head, tmp_path / "node.log", num_cpus=2,
                         args=("--resources", '{"inference": 1}'))
        view = StateView(head.dashboard_url)
        nodes = [n for n in view.nodes() if n["state"] == "ALIVE"]
        assert len(nodes) == 2, nodes
        head_id = next(n["node_id"] for n in nodes if n["is_head_node"])
        inference_id = next(n["node_id"] for n in nodes if not n["is_head_node"])
        assert len({n["node_ip"] for n in nodes}) == 1  # told apart by node id alone
        run_dir = tmp_path / "run"

        # 1. pinned: rollout on the inference node, the trainer on the head
        log1 = tmp_path / "job1.log"
        job = start_job(head, tmp_path, log1, f"train.steps={FIRST}", "model.path=" + embedded_model,
                        "rollout.resources={inference: 1}")
        seen: list[dict] = []
        while job.poll() is None:
            if (now := view.placed())["replica"] and now["trainer"]:
                seen.append(now)
            time.sleep(2)
        assert job.returncode == 0, log1.read_text()[-4000:]
        assert seen, "no replica and trainer seen running together"
        assert all(s["replica"] == [inference_id] and s["trainer"] == [head_id] for s in seen), \
            (seen, head_id, inference_id)
        # the run's own actors on the job's node: a lost inference node cannot take them
        assert all(set(s["driver"] + s["stage"]) == {head_id} for s in seen), (seen, head_id)
        first = steps_of(run_dir)
        assert [r["version"] for r in first] == list(range(1, FIRST + 1))
        assert {r["push_path"] for r in first} == {"collective"}, [r["push_path"] for r in first]
        assert all(r["replicas"] == 1 and r["push_bytes"] > 0 for r in first)
        ckpt = latest_checkpoint(run_dir / "train")
        assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == FIRST

        # 2. resumed, two unpinned replicas (Serve spreads them, one per node)
        skip = len(read_events(run_dir / "steps.jsonl"))
        log2 = tmp_path / "job2.log"
        job = start_job(head, tmp_path, log2, f"train.steps={TOTAL}", "model.path=" + embedded_model,
                        "run.resume=true", "rollout.min_replicas=2", "rollout.max_replicas=2",
                        # a broadcast to the lost node's replica gives up within 30 s
                        "weights.timeout_s=30")
        spread: list[dict] = []
        killed_after = survivor = None  # the last version pushed to the pair before the kill
        survived: list[int] = []  # versions done while the head's replica lived, after the kill
        while job.poll() is None:
            alive = view.alive()
            if len((now := {role: sorted(a["node_id"] for a in actors)
                            for role, actors in alive.items()})["replica"]) == 2:
                spread.append(now)
            done = steps_of(run_dir, skip)
            if killed_after is None and sorted(now["replica"]) == sorted([head_id, inference_id]):
                pair = [r["version"] for r in done if r["replicas"] == 2]
                if pair and pair[-1] < TOTAL - 2:  # steps left to run without the node
                    survivor = next(a["actor_id"] for a in alive["replica"] if a["node_id"] == head_id)
                    node.kill()
                    killed_after, t_kill = pair[-1], time.time()
            elif survivor in {a["actor_id"] for a in alive["replica"]} and done:
                survived.append(done[-1]["version"])
            time.sleep(1)
        out = log2.read_text()
        assert job.returncode == 0, out[-4000:]
        assert f"done: {TOTAL} steps" in out, out[-4000:]
        assert any(sorted(s["replica"]) == sorted([head_id, inference_id]) for s in spread), spread
        assert killed_after is not None, "the node was never killed while both replicas served"
        print(f"killed the second node after v{killed_after}; the run took "
              f"{time.time() - t_kill:.0f} s more")
        after = [r for r in steps_of(run_dir, skip) if r["version"] > killed_after + 1]
        assert after, killed_after
        assert after[-1]["replicas_lost"] >= 1 and after[-1]["replicas"] >= 1, after[-1]
        assert "rollout replica(s) lost" in out, out[-4000:]
        # the head's replica outlived the kill and served the later versions
        assert survived and max(survived) >= killed_after + 2, (survived, killed_after)
        assert all(r["replicas"] >= 1 for r in after), after
        events = read_events(run_dir / "steps.jsonl")[skip:]
        restores = [e["version"] for e in events if e.get("event") == "restore"]
        assert restores == [FIRST], restores  # resumed there, and the trainer never restarted
        recs = lineage(read_events(run_dir / "steps.jsonl"))
        assert [r["version"] for r in recs] == list(range(1, TOTAL + 1))
        # a replica on the trainer's node and one beside it: still the collective path
        assert any(r["replicas"] == 2 and r["push_path"] == "collective" for r in steps_of(run_dir, skip))
        # nothing of the job is left alive on the surviving node
        deadline = time.time() + 30
        while (left := {role: ids for role, ids in view.placed().items() if ids}) \
                and time.time() < deadline:
            time.sleep(1)
        assert not left, left
    finally:
        if job is not None and job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        if node is not None:
            node.stop()
        head.stop()
