"""The sweep on a live cluster (areal_ray/cluster/cleanup.py): a trainer's restart removes
its own job's files of dead writers, never another live job's, and a dry run removes
nothing; a dead job's replica reaps its own app and files only (`reap`). The rules are
table-tested in test_ownership.py; a killed job's clean-up end to end in
tests/jobs/test_cleanup.py."""

import os
import time

import pytest

from areal_ray.cluster import cleanup
from areal_ray.cluster.ownership import Owned, sandbox_dir_prefix
from areal_ray.cluster.placement import delete_app
from areal_ray.weights.staging import shm_dir

ME, OTHER, DEAD = Owned("feedf00d"), Owned("0123abcd"), Owned("deadbeef")
GONE = 2 ** 22 + 12345  # above the default pid_max: no process has it


def test_sweep_local_files(ray_cluster, tmp_path, monkeypatch):
    @ray_cluster.remote(num_cpus=0)
    class Holder:
        pass

    drivers = [Holder.options(name=o.driver_name).remote() for o in (ME, OTHER)]
    ray_cluster.get([d.__ray_ready__.remote() for d in drivers])
    monkeypatch.setattr(cleanup, "weight_dirs", lambda: [tmp_path])
    c = cleanup.this_cluster()
    files = {
        ME.weight_file("weights", c, os.getpid(), "0.bin"): False,  # this trainer's
        ME.weight_file("weights", c, GONE, "0.bin"): True,          # the incarnation before
        OTHER.weight_file("weights", c, GONE, "0.bin"): False,      # a live job's: its own business
        DEAD.weight_file("vllm", c, os.getpid(), "x.safetensors"): True,  # a dead job's
        DEAD.weight_file("vllm", c + 1, os.getpid(), "x.safetensors"): False,  # another cluster's
        "areal-weights-5f3a9c01be77-0.bin": False,                  # unowned
        ME.weight_file("ipc", c, GONE, "vllm"): True,               # a killed engine's sockets
        sandbox_dir_prefix(GONE) + "x1": True,                      # a killed reward process's
        sandbox_dir_prefix(os.getpid()) + "x2": False,              # a check still running
    }
    for name in files:
        if "-ipc-" in name or "-sandbox-" in name:  # directories, with files in them
            (tmp_path / name).mkdir()
            (tmp_path / name / "f").write_bytes(b"x")
        else:
            (tmp_path / name).write_bytes(b"x")
    try:
        stale = sorted(str(tmp_path / n) for n, gone in files.items() if gone)
        assert cleanup.sweep_local_files(dry_run=True, own_tag=ME.tag) == stale
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
        assert cleanup.sweep_local_files(dry_run=False, own_tag=ME.tag) == stale
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, g in files.items() if not g)
    finally:
        for d in drivers:
            ray_cluster.kill(d)


def test_the_sweep_reads_its_own_nodes_files_without_a_task(ray_cluster, tmp_path, monkeypatch):
    """A job's start-up sweep on a one-node cluster: the files of the node it runs on are
    read in its own process (weight_dirs patched here is seen), no task is started."""
    class NoTask:
        def options(self, **_):
            raise AssertionError("a task was started for the sweeping process's own node")

    monkeypatch.setattr(cleanup, "_sweep_node_files", NoTask())
    monkeypatch.setattr(cleanup, "weight_dirs", lambda: [tmp_path])
    dead = DEAD.weight_file("weights", cleanup.this_cluster(), os.getpid(), "0.bin")
    (tmp_path / dead).write_bytes(b"x")
    (node,) = [n for n in ray_cluster.nodes() if n["Alive"]]
    report = cleanup.sweep(dry_run=True)
    assert report.files == [f"{node['NodeManagerAddress']}:{tmp_path / dead}"]
    assert (tmp_path / dead).exists()


def test_sweep_removes_a_dead_jobs_app_on_a_cluster_without_a_dashboard(ray_cluster):
    """The start-up sweep of every job (areal_ray/run/job.py), on the kind of cluster where
    Ray's state API does not answer: Serve apps, every node's files, the GCS tables."""
    from ray import serve

    @ray_cluster.remote(num_cpus=0)
    class Holder:
        pass

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class App:
        def __call__(self):
            return "ok"

    live = Holder.options(name=OTHER.driver_name).remote()
    ray_cluster.get(live.__ray_ready__.remote())
    serve.start(proxy_location="Disabled")
    for o in (DEAD, OTHER):
        serve.run(App.bind(), name=o.app_name, route_prefix=None)
    try:
        dry = cleanup.sweep(dry_run=True)
        assert dry.apps == [DEAD.app_name] and dry.notes == []
        assert DEAD.app_name in serve.status().applications
        report = cleanup.sweep()
        assert report.apps == [DEAD.app_name]
        assert f"removed Serve app {DEAD.app_name}" in report.lines()
        apps = serve.status().applications
        assert DEAD.app_name not in apps and OTHER.app_name in apps
    finally:
        for o in (DEAD, OTHER):
            delete_app(o.app_name)
        ray_cluster.kill(live)


def test_an_unnamed_actor_is_killed_by_its_id(ray_cluster):
    """How a stale placement-group cleaner (unnamed, detached) is ended: `ray.kill`
    needs a handle, made from the id the GCS table lists."""
    @ray_cluster.remote(num_cpus=0)
    class Loop:
        def pid(self):
            return os.getpid()

    actor = Loop.remote()
    ray_cluster.get(actor.pid.remote())
    ray_cluster.kill(cleanup._handle(actor._actor_id.hex()), no_restart=True)
    # The kill travels through the GCS, a call straight to the actor: one may still run.
    deadline = time.time() + 30
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        while time.time() < deadline:
            ray_cluster.get(actor.pid.remote(), timeout=30)
            time.sleep(0.5)


def test_an_owner_is_alive_while_its_driver_actor_is(ray_cluster):
    @ray_cluster.remote(num_cpus=0)
    class Holder:
        pass

    driver = Holder.options(name=DEAD.driver_name, namespace="owners").remote()
    ray_cluster.get(driver.__ray_ready__.remote())
    assert cleanup.owner_alive(DEAD.driver_name, "owners")
    assert not cleanup.owner_alive(DEAD.driver_name, "another-namespace")
    ray_cluster.kill(driver)
    deadline = time.time() + 30  # the name goes once the GCS has the actor dead
    while cleanup.owner_alive(DEAD.driver_name, "owners") and time.time() < deadline:
        time.sleep(0.2)
    assert not cleanup.owner_alive(DEAD.driver_name, "owners")


def test_a_dead_jobs_replica_reaps_its_own_app_and_files_only(ray_cluster):
    """`cleanup.reap` as a rollout replica runs it when its job's driver is gone: from
    inside the app it deletes (the call returns; Serve then ends the replica), on the
    node's real weight dirs; another job's app and files stay, and a second replica's
    reap of the same job is harmless."""
    import asyncio

    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Replica:
        async def reap(self, tag: str) -> list[str]:
            return (await asyncio.to_thread(cleanup.reap, tag)).lines()

    c = cleanup.this_cluster()
    files = [shm_dir() / DEAD.weight_file("weights", c, os.getpid(), "0.bin"),
             shm_dir() / OTHER.weight_file("weights", c, os.getpid(), "0.bin")]
    for f in files:
        f.write_bytes(b"x")
    serve.start(proxy_location="Disabled")
    handles = {o: serve.run(Replica.bind(), name=o.app_name, route_prefix=None)
               for o in (DEAD, OTHER)}
    try:
        lines = handles[DEAD].reap.remote(DEAD.tag).result(timeout_s=60)
        assert f"removed Serve app {DEAD.app_name}" in lines
        assert [ln for ln in lines if ln.startswith("removed weight file ")
                and ln.endswith(f":{files[0]}")], lines
        assert not files[0].exists() and files[1].exists()
        deadline = time.time() + 60  # Serve's controller ends the app's replicas
        while DEAD.app_name in serve.status().applications and time.time() < deadline:
            time.sleep(0.5)
        apps = serve.status().applications
        assert DEAD.app_name not in apps and OTHER.app_name in apps
        again = cleanup.reap(DEAD.tag)  # as a second replica would: nothing left, no error
        assert not [f for f in again.files if DEAD.tag in f], again.files
    finally:
        for f in files:
            f.unlink(missing_ok=True)
        for o in (DEAD, OTHER):
            delete_app(o.app_name)


def test_the_report_names_each_kind_of_thing_it_removed():
    report = cleanup.SweepReport(dry_run=False, apps=[DEAD.app_name], files=[
        f"10.0.0.5:/dev/shm/{DEAD.weight_file('weights', 6379, 7, '0.bin')}",
        f"10.0.0.5:/tmp/{DEAD.weight_file('ipc', 6379, 7, 'vllm')}",
        f"10.0.0.5:/tmp/{sandbox_dir_prefix(7)}x1"])
    assert report.lines() == [
        f"removed Serve app {DEAD.app_name}",
        f"removed weight file {report.files[0]}",
        f"removed vLLM IPC socket dir {report.files[1]}",
        f"removed reward sandbox dir {report.files[2]}"]
