"""Clean-up that survives kills, on a cluster started with `ray start --head`: the
training job is SIGKILLed mid-run (no `finally` runs), and within 60 s its Serve app,
its replicas and its /dev/shm weight files are gone, removed by its own replicas when
they find its driver actor dead (cleanup.reap), with no sweep run by hand and no other
job started; a second, live owner's app, driver actor and files stay untouched, and
`python -m jobs.cleanup` afterwards finds nothing. The ownership rules themselves are
table-tested in tests/cluster/test_ownership.py, `reap` in tests/cluster/test_cleanup.py."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from areal_ray.cluster.ownership import cluster_of, parse_weight_file

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
LIVE = "0a1b2c3d"  # the live second owner's tag

# What the cluster holds, read by a driver of its own (it must not be the test process:
# other tests of the session own a local Ray there), once per line on its stdin: one
# process for every look (a fresh one each time cost an import of Ray and Serve,
# 2.7 CPU-s, and an attach).
PROBE = """
import json, sys, ray
from ray import serve
from ray._private import state
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
from ray.util.state import list_placement_groups
for _ in sys.stdin:
  print(json.dumps({
    "apps": {n: a.status.value for n, a in serve.status().applications.items()},
    "drivers": sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)),
    "jobs": {j["JobID"]: {"pid": j["DriverPid"], "dead": j["IsDead"]} for j in state.jobs()},
    "pgs": [{"job": p.creator_job_id, "state": p.state} for p in list_placement_groups(detail=True)],
    "cleaners": [a["JobID"] for a in state.actors(actor_state_name="ALIVE").values()
                 if a["ActorClassName"] == "PlacementGroupCleaner"],
    "replicas": sorted(a["ActorClassName"] for a in state.actors(actor_state_name="ALIVE").values()
                       if a["ActorClassName"].startswith("ServeReplica:")),
  }), flush=True)
"""

# A second job that stays alive: its driver actor, a Serve app and two weight files,
# one of them written by a process that is gone (another job's dead writer: not ours).
LIVE_OWNER = """
import os, sys, time, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="live-owner", logging_level="ERROR")

@ray.remote(num_cpus=0)
class Holder:
    pass

driver = Holder.options(name="areal-driver-%(tag)s").remote()
ray.get(driver.__ray_ready__.remote())

@serve.deployment(ray_actor_options={"num_cpus": 0})
class App:
    def __call__(self):
        return "ok"

serve.start(proxy_location="Disabled")  # as the job starts Serve: either may come first
serve.run(App.bind(), name="areal-rollout-%(tag)s", route_prefix=None)
port = sys.argv[1].rsplit(":", 1)[1]
for name in ("areal-weights-%%s-%(tag)s-%%d-0.bin" %% (port, os.getpid()),
             "areal-weights-%%s-%(tag)s-999999-1.bin" %% port):
    open(os.path.join("/dev/shm", name), "wb").write(b"x")
sys.stdin.read()  # until the test closes it
""" % {"tag": LIVE}  # noqa: UP031 - the template is code with braces of its own


class Probe:
    """The PROBE process: calling it returns what the cluster holds now. Its stdout is
    read by a thread into a queue, so a line that arrives with another (Ray's own, say)
    is never left waiting in a buffer that select() cannot see."""

    def __init__(self, cluster: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, cluster["gcs_address"]],
                                     env=cluster["env"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # it exited

    def __call__(self) -> dict:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        deadline = time.time() + 120
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise AssertionError(f"the probe did not answer in 120 s: "
                                     f"{self.log.read_text()[-3000:]}") from None
            if line.startswith("{"):
                return json.loads(line)
            assert line, self.log.read_text()[-3000:]  # exited
            # else a line of Ray's own on its stdout (a raylet warning)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def cleanup(cluster: dict, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "jobs.cleanup", f"address={cluster['gcs_address']}",
                          *args], cwd=REPO, env=cluster["env"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def shm_files(tag: str) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"areal-*-{tag}-*"))


def test_a_killed_jobs_app_and_weight_files_go_by_themselves_and_a_live_ones_stay(head_cluster,
                                                                                   tmp_path):
    env = dict(head_cluster["env"], PYTHONUNBUFFERED="1")
    before = {p.name for p in SHM.iterdir()}
    log = tmp_path / "job.log"
    job = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", "--config", "conf/quickstart.yaml",
         "train.steps=1000", "algo.batch_groups=4", "rollout.group_size=4",
         "rollout.max_new_tokens=48", "run.eval_before=false", "run.eval_after=false",
         "run.name=killed", f"run.run_dir={tmp_path / 'run'}",
         f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
         f"run.ray_address={head_cluster['gcs_address']}"],
        cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    # The live owner and the probe start beside the job (they wait on nothing of it).
    owner_log = tmp_path / "owner.log"
    owner = subprocess.Popen([sys.executable, "-c", LIVE_OWNER, head_cluster["gcs_address"]],
                             env=env, stdin=subprocess.PIPE, stdout=owner_log.open("w"),
                             stderr=subprocess.STDOUT)
    probe = Probe(head_cluster, tmp_path / "probe.log")
    tag = ""
    try:
        # Running: its app serves and its trainer has pushed weights through /dev/shm.
        # (Other jobs on this machine write weight files too, the other lane's among them:
        # only a new one of this cluster's, not the live owner's.)
        cluster = cluster_of(head_cluster["gcs_address"])
        deadline = time.time() + 300
        while not (tags := {t[1] for p in SHM.glob("areal-weights-*") if p.name not in before
                            and (t := parse_weight_file(p.name)) and t[0] == cluster
                            and t[1] != LIVE}):
            assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(2)
        (tag,) = tags
        seen = probe()
        assert seen["apps"].get(f"areal-rollout-{tag}") == "RUNNING", seen
        replica = f"ServeReplica:areal-rollout-{tag}:"
        assert any(r.startswith(replica) for r in seen["replicas"]), seen
        job_id = next(j for j, v in seen["jobs"].items() if v["pid"] == job.pid and not v["dead"])
        assert any(p["job"] == job_id and p["state"] == "CREATED" for p in seen["pgs"]), seen

        deadline = time.time() + 120
        while len(shm_files(LIVE)) < 2:  # written once its app runs
            assert owner.poll() is None and time.time() < deadline, owner_log.read_text()[-3000:]
            time.sleep(1)

        os.kill(job.pid, signal.SIGKILL)  # no finally, no atexit
        job.wait(30)
        # Within 60 s, with nothing run by hand and no job started: Ray ends the job, its
        # (non-detached) driver actor, its Train placement group and cleaner; the job's
        # replicas find the driver gone and remove their app and the job's weight files.
        deadline = time.time() + 60
        while True:
            seen = probe()
            done = seen["jobs"][job_id]["dead"] and f"areal-driver-{tag}" not in seen["drivers"] \
                and not any(p["job"] == job_id and p["state"] != "REMOVED" for p in seen["pgs"]) \
                and job_id not in seen["cleaners"] \
                and f"areal-rollout-{tag}" not in seen["apps"] \
                and not any(r.startswith(replica) for r in seen["replicas"]) \
                and not shm_files(tag)
            if done or time.time() > deadline:
                break
            time.sleep(3)
        assert done, (seen, shm_files(tag))
        # The live owner's app, driver and files, the dead writer's included, are untouched.
        assert seen["apps"].get(f"areal-rollout-{LIVE}") == "RUNNING", seen
        assert f"areal-driver-{LIVE}" in seen["drivers"], seen
        assert len(shm_files(LIVE)) == 2
        # ...and the sweep by hand, kept for what a dead cluster leaves, finds nothing of
        # either (what it may find of earlier tests on this cluster is not this test's).
        dry = cleanup(head_cluster, "dry_run=true")
        assert tag not in dry and LIVE not in dry, dry
    finally:
        if job.poll() is None:
            os.kill(job.pid, signal.SIGKILL)
            job.wait(30)
        probe.close()
        if owner.poll() is None:
            owner.stdin.close()  # its driver exits; its app is swept by the cluster's teardown
            owner.wait(60)
        for t in (tag, LIVE):
            for name in shm_files(t) if t else []:
                (SHM / name).unlink(missing_ok=True)
