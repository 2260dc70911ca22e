"""The run's placement against the live cluster: refused before anything is deployed
when it cannot fit (`check_placement`), and every wait for placement bounded by
`run.placement_timeout_s`, ending in an error that says what was not placed.

Serve's `serve.run` waits forever for a replica no node can host and Ray Train retries
a worker group it cannot place forever (a controller error, retried without limit by
default); both only log a warning now and then. Here the Serve app is deployed without
waiting and polled against the deadline, and the Train worker group gets the same
deadline as its start timeout with controller retries off.

The run dir is Ray Train's storage path: its controller (on the job's node) leaves a
marker there and every worker looks for it before storing its part of a checkpoint, so
when the job and its trainer workers may be on different nodes the run dir must be
storage all of them mount (`check_run_dir`), or the run fails at its first checkpoint.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import replace
from pathlib import Path

import ray
from ray import serve

from areal_ray.cluster.plan import (
    TRAINER,
    Demand,
    Node,
    Placement,
    can_host,
    demands,
    memory_error,
    memory_plan,
    place,
    placement_error,
    sharing_error,
)
from areal_ray.config import ConfigError

# Read by Ray Train's worker group, and propagated by Ray Train from the job's process
# to its controller (ray/train/v2/_internal/constants.py, ENV_VARS_TO_PROPAGATE).
TRAIN_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


class PlacementError(ConfigError):
    """The run cannot be placed on this cluster (now, or within the deadline)."""


def cluster_nodes() -> list[Node]:
    return nodes_of([n for n in ray.nodes() if n.get("Alive")])


def nodes_of(infos: list[dict]) -> list[Node]:
    """`ray.nodes()` entries as the planner's nodes, each named by its address, and by
    its node id too where several share one (raylets of one machine)."""
    nodes = [Node.from_ray(n) for n in infos]
    seen = [n.name for n in nodes]
    return [replace(n, name=f"{n.name} ({info.get('NodeID', '?')[:8]})")
            if seen.count(n.name) > 1 else n for n, info in zip(nodes, infos)]


def check_placement(cfg, shape=None, nodes: list[Node] | None = None,
                    training: bool = True) -> Placement:
    """The run's placement on the cluster's nodes (all of their resources, as if the
    cluster were idle); PlacementError when it cannot fit, when it could not start
    (`sharing_error`: two trainer workers or too large engine shares on one GPU), or
    when a shared GPU lacks the memory for all on it (with `train.gpu_memory_gib` and
    the model's `shape`)."""
    nodes = cluster_nodes() if nodes is None else nodes
    needs = demands(cfg, training)
    p = place(needs, nodes)
    if not p.fits:
        raise PlacementError(placement_error(needs, p))
    if (why := sharing_error(cfg, p)) is not None:
        raise PlacementError(why)
    if shape is not None and cfg.train.gpu_memory_gib > 0:
        mem = memory_plan(cfg, shape, p, cfg.train.gpu_memory_gib)
        if not mem["fits"]:
            raise PlacementError(memory_error(mem))
    return p


# Filesystems (their type in /proc/self/mounts) whose paths are taken to be the same
# storage on every node that mounts them; any other is taken for the node's own disk
# (run.shared_storage overrides).
SHARED_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "beegfs", "glusterfs",
    "fuse.s3fs", "fuse.gcsfuse", "fuse.ceph-fuse", "fuse.glusterfs", "fuse.juicefs",
})
LATER_NODE = "a node yet to join"


def mount_fstype(path: str, mounts: str) -> str:
    """The type of the filesystem holding `path` (absolute, symlinks resolved): that of
    the deepest mount point above it in `mounts`, /proc/self/mounts' text ('' if none)."""
    best, fstype = -1, ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        # the kernel writes a space, tab, newline or backslash in a path as \ooo
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[1])
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # later lines are mounted over earlier ones
            best, fstype = len(point), parts[2]
    return fstype


def run_hosts(nodes: list[dict], here: str, trainer: Demand) -> list[str]:
    """The nodes that use the run dir as Ray Train's storage, among `nodes` (as
    `ray.nodes()` lists them): the job's own (node id `here`: its driver and Ray Train's
    controller) and every alive node that could host one `trainer` worker (its CPUs,
    GPUs and node type, as `place` judges a node); when none can now, an autoscaler's
    node yet to join."""
    alive = [n for n in nodes if n.get("Alive")]
    capable = [info for info in alive if can_host(Node.from_ray(info), trainer)]
    ids = [here] + [n["NodeID"] for n in capable if n["NodeID"] != here]
    names = {n["NodeID"]: n.get("NodeManagerAddress") or n["NodeID"][:8] for n in alive}
    return [names.get(i, i[:8]) for i in ids] + ([] if capable else [LATER_NODE])


def run_dir_problem(run_dir: str, fstype: str, hosts: list[str], shared: bool | None = None) -> str | None:
    """Why `run_dir` (on a filesystem of type `fstype`) cannot be the run's storage when
    `hosts` use it, or None. One host: any directory. Several: one they all mount,
    which `shared` says (run.shared_storage), or else its filesystem's type."""
    if len(hosts) <= 1 or shared or (shared is None and fstype in SHARED_FS):
        return None
    why = ("run.shared_storage=false" if shared is False
           else f"{fstype or 'unknown'} filesystem, not a network one this check knows")
    return (f"the run dir {run_dir} is this node's own storage ({why}), but the job and its trainer "
            f"workers may run on {len(hosts)} nodes ({', '.join(hosts)}): every worker stores its part "
            "of each checkpoint there, and Ray Train refuses a path its node lacks ('Unable to set up "
            "cluster storage'), so the run would fail at its first checkpoint. Pass run.run_dir=<a "
            "directory every node mounts at the same path> (NFS, Lustre, GPFS, CephFS, a bucket "
            "through s3fs or gcsfuse), or run.shared_storage=true if it is shared storage this check "
            "does not know.")


def check_run_dir(cfg, run_dir: str, nodes: list[dict] | None = None, here: str | None = None,
                  mounts: str | None = None) -> None:
    """ConfigError when `run_dir` (absolute) is not storage every node that uses it
    shares (`run_dir_problem`), with the live cluster's nodes and this node's mounts."""
    trainer = next(d for d in demands(cfg) if d.role == TRAINER)
    nodes = ray.nodes() if nodes is None else nodes
    here = ray.get_runtime_context().get_node_id() if here is None else here
    hosts = run_hosts(nodes, here, trainer)
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:  # not Linux: the type stays unknown, run.shared_storage decides
            mounts = ""
    fstype = mount_fstype(os.path.realpath(run_dir), mounts)
    if (why := run_dir_problem(run_dir, fstype, hosts, cfg.run.shared_storage)) is not None:
        raise ConfigError(why)


def app_problem(app_name: str) -> tuple[str, str]:
    """(state, detail) of a Serve app: state is running, failed or waiting."""
    status = serve.status().applications.get(app_name)
    if status is None:
        return "waiting", "the application is not known to Serve yet"
    if status.status == "RUNNING":
        return "running", ""
    parts = [status.message] if status.message else []
    for name, d in status.deployments.items():
        if d.status != "HEALTHY":
            states = ", ".join(f"{k}: {v}" for k, v in d.replica_states.items())
            parts.append(f"deployment {name} {d.status} (replicas {states or 'none'})"
                         + (f": {d.message}" if d.message else ""))
    return ("failed" if status.status == "DEPLOY_FAILED" else "waiting"), "; ".join(parts)


def wait_for_app(app_name: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Until the app runs; PlacementError naming its unready deployments at the deadline
    or at once when its deployment failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, detail = app_problem(app_name)
        if state == "running":
            return
        if state == "failed":
            raise PlacementError(f"the rollout app {app_name} failed to deploy: {detail}")
        if time.monotonic() > deadline:
            raise PlacementError(
                f"the rollout app {app_name} was not running after run.placement_timeout_s="
                f"{timeout_s:g}: {detail}. Its replicas may not fit what the cluster has free "
                "(other jobs' actors count); `ray status` shows the cluster's demands")
        time.sleep(poll_s)


def delete_app(app_name: str, timeout_s: float = 60.0, poll_s: float = 0.1) -> None:
    """`serve.delete`, with its wait at `poll_s`: Serve's own wait checks once a second,
    so an app whose replicas drain in a quarter of a second (rollout/engine_client.py,
    DRAIN_POLL_S) held every job's end for a whole second. (The controller takes the
    delete before the status calls after it: one caller's calls to an actor run in order.)"""
    serve.delete(app_name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while app_name in serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Serve app {app_name} was not deleted within {timeout_s:g} s")
        time.sleep(poll_s)


def delete_extra_apps(owned) -> None:
    """Delete the job's apps beside its rollout app that exist, each waited for: the
    served rewards' and the distillation teacher's (ownership.SERVED_APP_PREFIXES)."""
    for name in owned.extra_apps(serve.status().applications):
        delete_app(name)


def deploy_app(app, app_name: str, timeout_s: float, route_prefix: str | None = None,
               wait: bool = True):
    """Deploy `app` without Serve's unbounded wait, then (`wait`) wait with the deadline.
    The ingress handle; without `wait` the caller calls `wait_for_app` later."""
    handle = serve.run_many([serve.RunTarget(app, name=app_name, route_prefix=route_prefix)],
                            wait_for_applications_running=False)[0]
    if wait:
        wait_for_app(app_name, timeout_s)
    return handle


def bound_train_start(timeout_s: float) -> None:
    """Ray Train waits this long for its worker group to be placed (each attempt)."""
    os.environ[TRAIN_START_TIMEOUT_ENV] = f"{timeout_s:g}"


def train_start_problem(error: BaseException, cfg) -> str | None:
    """The message for a trainer whose worker group could not be placed in time, when
    `error` (from `trainer.fit`) is that; None otherwise."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        failure = getattr(e, "controller_failure", None)  # ray.train.ControllerError
        if isinstance(e, WorkerGroupStartupTimeoutError) or \
                isinstance(failure, WorkerGroupStartupTimeoutError):
            t = cfg.train
            gpu = f", {t.num_gpus_per_worker:g} GPU" if t.use_gpu else ""
            return (f"the trainer's {t.num_workers} worker(s) ({t.num_cpus_per_worker:g} CPU{gpu} "
                    f"each) could not be placed within run.placement_timeout_s="
                    f"{cfg.run.placement_timeout_s:g}: the cluster has not that much free now "
                    "(other jobs' actors count; `ray status` shows the demands)")
        e = e.__cause__ or e.__context__
    return None
