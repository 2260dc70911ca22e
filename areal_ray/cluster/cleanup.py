"""Removing what dead jobs left on the cluster: `reap`, which the job's own rollout
replicas run as soon as they see its driver actor gone (however the job died: SIGKILL,
`ray job stop`, an exception), so nothing waits for a person or for the next job; the
sweep a job runs when it starts; and `python -m jobs.cleanup`, for what a cluster that
died with its jobs left. Which resources are garbage is decided in `ownership.py`; this
module only looks at the cluster and removes.

Each kind is listed before its owners are read (see ownership.py): Serve apps from
`serve.status()`, weight files on every alive node (/dev/shm is per node, and a
writer's pid means something only there: a zero-CPU task on each other node, this
process itself on its own), Ray Train's placement-group
cleaners from the GCS actor table. The GCS tables, not the state API (`ray.util.state`),
because the cleaners loop exactly where the state API is missing (no dashboard).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_ray.cluster.ownership import (
    PG_CLEANER_CLASS,
    Actor,
    Owned,
    cluster_of,
    live_tags,
    owned_by,
    stale_apps,
    stale_files,
    stale_pg_cleaners,
    stale_sandbox_dirs,
)
from areal_ray.cluster.placement import delete_app
from areal_ray.weights.staging import weight_dirs


@dataclass
class SweepReport:
    dry_run: bool
    apps: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # "<node ip>:<path>"
    pg_cleaners: list[str] = field(default_factory=list)  # actor ids
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why

    def lines(self) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        out = [f"{verb} Serve app {a}" for a in self.apps]
        out += [f"{verb} {_kind(f)} {f}" for f in self.files]
        out += [f"{verb} Ray Train placement-group cleaner actor {a}" for a in self.pg_cleaners]
        out += [f"not checked: {n}" for n in self.notes]
        return out


def _kind(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    if name.startswith("areal-sandbox-"):
        return "reward sandbox dir"
    return "vLLM IPC socket dir" if name.startswith("areal-ipc-") else "weight file"


def this_cluster() -> int:
    """The connected cluster's id for weight file names (ownership.cluster_of)."""
    return cluster_of(ray.get_runtime_context().gcs_address)


def weight_file_name(kind: str, owner: str, rest: str) -> str:
    """The name of a weight file this process writes: with `owner` (the job's tag) the
    owned name a sweep can judge (`ownership.Owned.weight_file`: this cluster, this
    pid); without (benchmarks, tests), `areal-<kind>-<rest>`, which no sweep touches."""
    if not owner:
        return f"areal-{kind}-{rest}"
    return Owned(owner).weight_file(kind, this_cluster(), os.getpid(), rest)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_local_files(dry_run: bool, own_tag: str = "", only_tag: str = "") -> list[str]:
    """This node's stale weight files and IPC dirs (ownership.stale_files; with
    `only_tag`, only that dead job's) and reward-check dirs of dead processes
    (ownership.stale_sandbox_dirs), removed unless `dry_run`."""
    listed = {}
    for d in weight_dirs():
        try:
            listed.update({p.name: p for p in d.iterdir() if p.name.startswith("areal-")})
        except OSError:
            continue
    # Owners are read after the files are listed (ownership.py).
    live = live_tags(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
    names = stale_files(listed, this_cluster(), live, pid_alive, own_tag)
    if only_tag:
        names = owned_by(names, only_tag)
    stale = [listed[n] for n in names + stale_sandbox_dirs(listed, pid_alive)]  # the temp dir's
    if not dry_run:
        for p in stale:  # a replica's adapters are directories (adapters.py)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return sorted(str(p) for p in stale)


def this_node() -> str | None:
    """The node this process runs on, whose files the sweep reads itself: a task there
    would start a worker process (~1 s per job on a one-node cluster) to do the same.
    None for a Ray Client session, whose process is on no node of the cluster."""
    if ray.util.client.ray.is_connected():
        return None
    return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, max_retries=0)
def _sweep_node_files(dry_run: bool, own_tag: str, only_tag: str = "") -> list[str]:
    return sweep_local_files(dry_run, own_tag, only_tag)


def _sweep_files(report: SweepReport, own_tag: str = "", only_tag: str = "") -> None:
    """Each alive node's files (/dev/shm is per node; so is a writer's pid)."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    here = this_node()
    tasks = {n["NodeID"]: _sweep_node_files.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
    ).remote(report.dry_run, own_tag, only_tag) for n in nodes if n["NodeID"] != here}
    found = dict(zip(tasks, ray.get(list(tasks.values()), timeout=120)))
    if here is not None and any(n["NodeID"] == here for n in nodes):
        found[here] = sweep_local_files(report.dry_run, own_tag, only_tag)
    report.files = [f"{n['NodeManagerAddress']}:{p}" for n in nodes for p in found[n["NodeID"]]]


def owner_alive(driver_name: str, namespace: str) -> bool:
    """Whether the job's driver actor still lives: Ray drops the name of a dead
    non-detached actor, so a lookup that finds no such actor is a dead owner (a call
    that failed with an `ActorUnavailableError` alone is not: the link may come back;
    nor is a lookup the GCS did not answer)."""
    try:
        ray.get_actor(driver_name, namespace=namespace)
    except ValueError:
        return False
    except Exception:  # noqa: BLE001 - the GCS did not answer: not known dead, nothing removed
        return True
    return True


def reap(tag: str, dry_run: bool = False) -> SweepReport:
    """Remove what the dead job tagged `tag` owned and nothing else: its Serve apps and
    its files on every node (and any node's reward-check dirs of dead processes). Run
    by that job's own replicas, each once, when they find its driver gone: the app's
    deletion is only requested (Serve's controller deletes it, this replica included,
    after this returns: a replica that waited for its own deletion would wait forever),
    and every step is harmless when another replica has done it already."""
    from ray import serve

    owned = Owned(tag)
    live = serve.status().applications  # a served reward's app exists only where the run had one
    report = SweepReport(dry_run, apps=[owned.app_name, *owned.extra_apps(live)])
    if not dry_run:
        for app in report.apps:
            serve.delete(app, _blocking=False)  # a no-op for an app already gone
    _sweep_files(report, only_tag=tag)
    return report


def sweep(dry_run: bool = False, own_tag: str = "") -> SweepReport:
    """Remove (or with `dry_run` only list) what dead jobs left on the connected cluster.
    `own_tag`: the sweeping job's tag, whose files of dead writers go too."""
    from ray import serve

    report = SweepReport(dry_run)
    apps = list(serve.status().applications)  # empty, and no Serve started, when none runs
    live = live_tags(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
    report.apps = stale_apps(apps, live)
    if not dry_run:
        for app in report.apps:
            delete_app(app)  # returns once its replicas are gone

    _sweep_files(report, own_tag)

    from ray._private import (
        state,  # GCS tables: answer without the dashboard (docstring)
    )
    actors = [Actor(a["ActorID"], a["ActorClassName"], a["JobID"], a["State"])
              for a in state.actors(actor_state_name="ALIVE").values()
              if a["ActorClassName"] == PG_CLEANER_CLASS]
    live_jobs = frozenset(j["JobID"] for j in state.jobs() if not j["IsDead"])
    report.pg_cleaners = stale_pg_cleaners(actors, live_jobs)
    if not dry_run:
        for actor_id in report.pg_cleaners:
            try:
                ray.kill(_handle(actor_id), no_restart=True)
            except Exception as e:  # noqa: BLE001 - one actor's failure must not stop the sweep
                report.notes.append(f"placement-group cleaner {actor_id} could not be killed: {e}")
    return report


def _handle(actor_id: str):
    """A handle to an unnamed actor, by id: `ray.kill` takes only handles, and Ray has no
    public lookup of an unnamed detached actor."""
    from ray._raylet import ActorID
    worker = ray._private.worker.global_worker
    return worker.core_worker.get_actor_handle(ActorID.from_hex(actor_id))
