"""The run's placement against the live cluster: refused before anything is deployed
when it cannot fit (`check_placement`), and every wait for placement bounded by
`run.placement_timeout_s`, ending in an error that says what was not placed.

Serve's `serve.run` waits forever for a replica no node can host and Ray Train retries
a worker group it cannot place forever (a controller error, retried without limit by
default); both only log a warning now and then. Here the Serve app is deployed without
waiting and polled against the deadline, and the Train worker group gets the same
deadline as its start timeout with controller retries off.
"""

from __future__ import annotations

import os
import time

import ray
from ray import serve

from areal_ray.cluster.plan import Node, Placement, demands, memory_error, memory_plan, place, placement_error
from areal_ray.config import ConfigError

# Read by Ray Train's worker group, and propagated by Ray Train from the job's process
# to its controller (ray/train/v2/_internal/constants.py, ENV_VARS_TO_PROPAGATE).
TRAIN_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


class PlacementError(ConfigError):
    """The run cannot be placed on this cluster (now, or within the deadline)."""


def cluster_nodes() -> list[Node]:
    return [Node.from_ray(n) for n in ray.nodes() if n.get("Alive")]


def check_placement(cfg, shape=None, nodes: list[Node] | None = None,
                    training: bool = True) -> Placement:
    """The run's placement on the cluster's nodes (all of their resources, as if the
    cluster were idle); PlacementError when it cannot fit, or when a GPU shared by an
    engine and a trainer worker lacks the memory for both (with `train.gpu_memory_gib`
    and the model's `shape`)."""
    nodes = cluster_nodes() if nodes is None else nodes
    needs = demands(cfg, training)
    p = place(needs, nodes)
    if not p.fits:
        raise PlacementError(placement_error(needs, p))
    if shape is not None and cfg.train.gpu_memory_gib > 0:
        mem = memory_plan(cfg, shape, p, cfg.train.gpu_memory_gib)
        if not mem["fits"]:
            raise PlacementError(memory_error(mem))
    return p


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
