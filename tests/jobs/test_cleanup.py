"""Clean-up that survives kills, on a cluster started with `ray start --head`: the
training job is SIGKILLed mid-run (no `finally` runs), and within 60 s its Serve app,
its replicas and its /dev/shm weight files are gone, removed by its own replicas when
they find its driver actor dead (cleanup.reap), with no sweep run by hand and no other
job started; a second, live owner's app, driver actor and files stay untouched, and
`python -m jobs.cleanup` afterwards finds nothing. A job stopped with `ray job stop`
and one whose trainer raises leave nothing either (`leftovers`: app, replicas, driver
actor, placement group, weight files and IPC dirs, the cluster's CPUs and GPUs free
again). The ownership rules themselves are
table-tested in tests/cluster/test_ownership.py, `reap` in tests/cluster/test_cleanup.py."""

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from areal_ray.cluster.cleanup import pid_alive
from areal_ray.cluster.ownership import cluster_of, parse_weight_file, stale_sandbox_dirs
from areal_ray.train.batch_record import RECORD_DIR, BatchRecorder, step_path
from areal_ray.train.feeder import StepBatch
from areal_ray.types import Group, Sample
from areal_ray.weights.staging import disk_dir, weight_dirs

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
TMP = disk_dir()  # the temp dir, the cluster's processes' too (they inherit TMPDIR)
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
    "resources": {k: [ray.available_resources().get(k, 0.0), v]
                  for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")},
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


def owned_files(tag: str) -> list[str]:
    """The job's files on this (the only) node: weight files in /dev/shm, and in the
    temp dir its vLLM IPC socket dirs and weight files that did not fit /dev/shm."""
    return sorted(str(p) for d in weight_dirs() for p in d.glob(f"areal-*-{tag}-*"))


def sandbox_dirs() -> set[str]:
    """Reward-check program dirs in the temp dir whose maker is dead (what a killed
    check leaves; a live one's is still in use)."""
    return set(stale_sandbox_dirs((p.name for p in TMP.glob("areal-sandbox-*")), pid_alive))


def leftovers(seen: dict, job_id: str, tag: str, sandboxes_before: set[str]) -> list[str]:
    """What the job `job_id` tagged `tag` owned and the cluster `seen` (a Probe's look)
    still holds, one entry each; the cluster's CPUs and GPUs are all free again once
    nothing of it runs. Empty: nothing left."""
    left = [] if seen["jobs"][job_id]["dead"] else [f"job {job_id} alive"]
    left += [d for d in seen["drivers"] if d == f"areal-driver-{tag}"]
    left += [f"placement group {p['state']}" for p in seen["pgs"]
             if p["job"] == job_id and p["state"] != "REMOVED"]
    left += [f"placement-group cleaner of {j}" for j in seen["cleaners"] if j == job_id]
    left += [f"app {a}" for a in seen["apps"] if a == f"areal-rollout-{tag}"]
    left += [r for r in seen["replicas"] if r.startswith(f"ServeReplica:areal-rollout-{tag}:")]
    left += owned_files(tag) + sorted(sandbox_dirs() - sandboxes_before)
    left += [f"{k}: {free:g} of {total:g} free" for k, (free, total) in seen["resources"].items()
             if abs(free - total) > 1e-6]
    return left


def gone_within(probe: Probe, seconds: float, *args) -> tuple[list[str], dict, float]:
    """Looks until nothing is left (`leftovers(look, *args)`) or `seconds` pass: what
    is left at the last look, that look, and the seconds it took."""
    t0 = time.time()
    while True:
        seen = probe()
        left = leftovers(seen, *args)
        if not left or time.time() - t0 > seconds:
            return left, seen, time.time() - t0
        time.sleep(2)


def new_tag(before: set[str], cluster: int) -> set[str]:
    """Tags of this cluster's weight files written since `before` was listed, but the
    live owner's (other jobs on this machine write weight files too, the other lane's
    among them)."""
    return {t[1] for p in SHM.glob("areal-weights-*") if p.name not in before
            and (t := parse_weight_file(p.name)) and t[0] == cluster and t[1] != LIVE}


def test_a_killed_jobs_app_and_weight_files_go_by_themselves_and_a_live_ones_stay(head_cluster,
                                                                                   tmp_path):
    env = dict(head_cluster["env"], PYTHONUNBUFFERED="1")
    before = {p.name for p in SHM.iterdir()}
    sandboxes_before = sandbox_dirs()
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
        while not (tags := new_tag(before, cluster)):
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
        left, seen, took = gone_within(probe, 60, job_id, tag, sandboxes_before)
        assert not left, (left, seen)
        print(f"kill -9: nothing left {took:.0f} s later")
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


def job_client(cluster: dict):
    from ray.job_submission import JobSubmissionClient
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()  # token mode (head.py)
    return JobSubmissionClient(cluster["dashboard_url"], headers={"Authorization": f"Bearer {token}"})


def job_args(tmp_path: Path, name: str, *args: str) -> list[str]:
    return ["--config", "conf/quickstart.yaml", "run.eval_before=false", "run.eval_after=false",
            f"run.name={name}", f"run.run_dir={tmp_path / 'run'}",
            f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", *args]


def test_a_job_stopped_with_ray_job_stop_leaves_nothing(head_cluster, tmp_path):
    """`ray job stop` mid-run (SIGTERM to the job's processes, SIGKILL 3 s later: the job
    has no handler for it, so no `finally` runs) of a submitted job: within 60 s its
    app, replicas, driver, trainer, /dev/shm weight files are gone and the cluster's
    CPUs are all free, with nothing run by hand. (A vLLM replica's IPC socket dir goes
    the same way, `reap` in tests/cluster/test_cleanup.py; a vLLM replica took over
    90 s to start here on 2 loaded cores.)"""
    from ray.job_submission import JobStatus
    client = job_client(head_cluster)
    before = {p.name for p in SHM.iterdir()}
    sandboxes_before = sandbox_dirs()
    args = job_args(tmp_path, "stopped", "train.steps=1000", "algo.batch_groups=2",
                    "rollout.group_size=4", "rollout.max_new_tokens=32")
    sub = client.submit_job(entrypoint=f"cd {shlex.quote(str(REPO))} && exec "
                            f"{shlex.quote(sys.executable)} -m jobs.train {shlex.join(args)}")
    probe = Probe(head_cluster, tmp_path / "probe.log")
    tag = ""
    try:
        cluster = cluster_of(head_cluster["gcs_address"])
        deadline = time.time() + 480  # a first push took over 300 s on 2 cores shared 30 ways
        while not (tags := new_tag(before, cluster)):  # the trainer has pushed weights
            assert not client.get_job_status(sub).is_terminal() and time.time() < deadline, \
                client.get_job_logs(sub)[-3000:]
            time.sleep(2)
        (tag,) = tags
        job_id = client.get_job_info(sub).job_id
        # Running, it owns what the look below must find gone: its app and replica, its
        # driver actor, its trainer's placement group, its shm files, its engine's IPC dir.
        held = leftovers(probe(), job_id, tag, sandboxes_before)
        assert {f"app areal-rollout-{tag}", f"areal-driver-{tag}", "placement group CREATED"} \
            <= set(held), held
        assert any(h.startswith(f"ServeReplica:areal-rollout-{tag}:") for h in held), held
        assert any(Path(h).name.startswith("areal-weights-") for h in held), held

        assert client.stop_job(sub)
        left, seen, took = gone_within(probe, 60, job_id, tag, sandboxes_before)
        assert not left, (left, seen)
        print(f"ray job stop: nothing left {took:.0f} s later")
        assert client.get_job_status(sub) == JobStatus.STOPPED
    finally:
        if not client.get_job_status(sub).is_terminal():
            client.stop_job(sub)
        probe.close()
        for name in shm_files(tag) if tag else []:
            (SHM / name).unlink(missing_ok=True)


def recorded_group(ticket: int) -> Group:
    samples = [Sample([5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [-1.5] * 6, [0] * 6, "stop", reward=r)
               for r in (1.0, 0.0)]
    return Group(ticket, f"u{ticket}", "1+2=", "3", "math", 0, samples, pos=ticket)


def test_a_job_whose_trainer_raises_leaves_nothing(head_cluster, tmp_path):
    """A replay of recorded steps whose 7th step file is cut short (a torn copy): the
    trainer raises at that step, after six steps of training and weight pushes to the
    replica, and the job ends with the error naming the file and line. Within 60 s of
    its exit its app, replicas, driver, trainer, weight files are gone and the cluster's
    CPUs are all free."""
    steps, bad = 10, 6
    recording = BatchRecorder(tmp_path / "recorded" / RECORD_DIR, seed=None)
    for step in range(steps):
        recording.write(step, StepBatch([recorded_group(2 * step), recorded_group(2 * step + 1)],
                                        [], 0.0))
    torn = step_path(recording.root, bad)
    torn.write_text(torn.read_text()[:-40])  # its last group line loses its end
    before = {p.name for p in SHM.iterdir()}
    sandboxes_before = sandbox_dirs()
    log = tmp_path / "job.log"
    job = subprocess.Popen(
        [sys.executable, "-m", "jobs.train",
         *job_args(tmp_path, "raises", f"train.steps={steps}", "algo.batch_groups=2",
                   "rollout.group_size=2", f"run.replay={tmp_path / 'recorded'}",
                   f"run.ray_address={head_cluster['gcs_address']}")],
        cwd=REPO, env=dict(head_cluster["env"], PYTHONUNBUFFERED="1"), stdout=log.open("w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    probe = Probe(head_cluster, tmp_path / "probe.log")
    tag = ""
    try:
        cluster = cluster_of(head_cluster["gcs_address"])
        deadline = time.time() + 480  # a first push took over 300 s on 2 cores shared 30 ways
        while not (tags := new_tag(before, cluster)):  # the trainer has pushed weights
            assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        (tag,) = tags
        seen = probe()
        job_id = next(j for j, v in seen["jobs"].items() if v["pid"] == job.pid)
        held = leftovers(seen, job_id, tag, sandboxes_before)
        assert f"app areal-rollout-{tag}" in held, held

        assert job.wait(300) != 0
        out = log.read_text()
        assert f"run.replay: {torn}:3: not a recorded group" in out, out[-3000:]
        assert f"step {bad:>4}/{steps} " in out, out[-3000:]  # it trained up to the torn step
        left, seen, took = gone_within(probe, 60, job_id, tag, sandboxes_before)
        assert not left, (left, seen)
        print(f"trainer exception: nothing left {took:.0f} s after the job's exit")
    finally:
        if job.poll() is None:
            os.kill(job.pid, signal.SIGKILL)
            job.wait(30)
        probe.close()
        for name in shm_files(tag) if tag else []:
            (SHM / name).unlink(missing_ok=True)
