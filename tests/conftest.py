"""Shared fixtures: one local Ray cluster per test session, small models built on the spot."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
E2E_DIRS = {"jobs", "benchmarks", "notebooks", "deployments"}  # the real job, a bench, a notebook, a Serve app
E2E_MODULES = {"tests/cluster/test_two_node_job.py"}  # real jobs beside their folder's unit tests
RAY_FIXTURES = {"ray_cluster", "head_cluster"}
# a real inference engine's processes or a torch.distributed process group
ENGINE_FIXTURES = {"vllm_engine", "vllm_lora_engine", "one_rank_group"}
# The e2e modules `make test` runs in the other lane, once that lane's own modules are
# done, beside the rest of the e2e tier (pytest_xdist_make_scheduler), in this order.
# Chosen by measurement: most of these wait (a kill and its recovery, a notebook's
# kernel, a `ray start` cluster's job server; alone they kept 2 cores 59-79% busy), and
# with test_reproducible, test_bench_backends and test_bench_stream both lanes end about
# together (without the second the main lane ran ~100 s longer, twice; without the
# third, 113 s: the lane lines at the end of the output); test_bench_async and
# test_bench_rollout (~120 s and ~60 s) since test_faults' run and test_reproducible's
# deterministic pair (~340 s here) became jobs of test_resume, in the main lane (with
# both, the two lanes ended 1 s apart).
# The three that take `head_cluster` stay in one lane, so only one such cluster runs at
# a time, and come last, one after another: that cluster starts with the first of them,
# and idled ~540 s between them.
E2E_SECOND_LANE = tuple(f"tests/{m}.py" for m in (
    "benchmarks/test_bench_async", "benchmarks/test_bench_rollout", "benchmarks/test_bench_stream",
    "benchmarks/test_bench_backends", "jobs/test_eval", "jobs/test_gpu_check", "jobs/test_wheelhouse",
    "jobs/test_reproducible", "jobs/test_cleanup", "jobs/test_submit", "notebooks/test_notebooks"))


def in_e2e_dir(nodeid: str) -> bool:
    """Whether a test's module (its node id, relative to the repo) is in an e2e folder,
    or is one of E2E_MODULES."""
    module = nodeid.split("::")[0]
    parts = Path(module).parts
    return module in E2E_MODULES or (len(parts) > 2 and parts[0] == "tests" and parts[1] in E2E_DIRS)


def pytest_collection_modifyitems(config, items):
    """One tier marker per test, decided here rather than by hand in each file:
    `e2e` (tests/jobs, tests/benchmarks, tests/notebooks, tests/deployments: real
    jobs, benches and Serve apps),
    `ray` (a test that takes a Ray cluster fixture, or is marked `ray` in its file
    because it starts a cluster of its own), `engine` (no cluster, but a real
    inference engine's processes or a torch.distributed process group: a test that
    takes a fixture of ENGINE_FIXTURES, e.g. vLLM's engine or FSDP's one-rank gloo
    group, or is marked `engine` in its file because it starts a group itself, e.g. a
    WeightGroup broadcast over gloo), `unit` (the rest: no cluster, no engine
    processes, no process group). `make test-fast` runs the unit tier (kept under
    3 minutes on 2 cores); `make test` runs them all."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if in_e2e_dir(item.nodeid):
            item.add_marker(pytest.mark.e2e)
        elif RAY_FIXTURES & fixtures or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.ray)
        elif ENGINE_FIXTURES & fixtures or item.get_closest_marker("engine"):
            if not item.get_closest_marker("engine"):
                item.add_marker(pytest.mark.engine)
        else:
            item.add_marker(pytest.mark.unit)
    # the second lane's modules in E2E_SECOND_LANE's order (a scope runs in item order)
    second = {m: i for i, m in enumerate(E2E_SECOND_LANE)}
    items.sort(key=lambda item: second.get(item.nodeid.split("::")[0], -1))


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s two lanes (pytest-xdist, `--dist loadscope`): most of the e2e tier
    is one scope, so one worker runs its jobs one after another, and every other module
    is a scope the other worker takes meanwhile (measured: both lanes run ~1.4x slower
    while they overlap, and the suite ends ~10% sooner than in one process). The e2e
    scope is handed out first, so its lane starts at once; E2E_SECOND_LANE is one more
    scope handed out last, so the other worker runs it when its own modules are done
    (measured: before, that worker idled for the last ~1,200 s of a ~1,850 s run while
    the e2e lane kept the cores ~83% busy). Decided from the node id, not by an
    `xdist_group` mark: pytest 9.2's node ids no longer take the suffix that
    `--dist loadgroup` groups by (pytest-xdist #1386)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TwoLanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            if not in_e2e_dir(nodeid):
                return module
            return "e2e-2" if module in E2E_SECOND_LANE else "e2e"

        def _assign_work_unit(self, node) -> None:
            if "e2e" in self.workqueue:
                self.workqueue.move_to_end("e2e", last=False)
            if "e2e-2" in self.workqueue:
                self.workqueue.move_to_end("e2e-2")
            super()._assign_work_unit(node)

    return TwoLanes(config, log)


class Phase(NamedTuple):
    """One test phase (setup, call, teardown) as its report says it ran."""
    lane: str  # the xdist worker, or "main" in one process
    test: str  # node id
    when: str
    start: float
    stop: float


# Where each lane's time went, gathered where the reports arrive (xdist's controller,
# or the one process).
LANES: list[Phase] = []
T0 = time.time()


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller gets this report too, with the worker it came from
    node = getattr(report, "node", None)
    LANES.append(Phase(node.gateway.id if node is not None else "main", report.nodeid,
                       report.when, report.start, report.stop))
    if path := os.environ.get("AREAL_TEST_TIMELINE"):  # as each phase ends: a stopped run keeps its lines
        with open(path, "a") as f:
            f.write(json.dumps(LANES[-1]._replace(start=report.start - T0, stop=report.stop - T0)._asdict()) + "\n")


def pytest_terminal_summary(terminalreporter):
    """One line per lane: its tests' seconds and when its last test ended, so the lanes'
    split (E2E_SECOND_LANE) can be judged from CI's output. AREAL_TEST_TIMELINE=<file>
    also gets every phase as a JSON line as it ends (times from the session's start).
    Then the e2e modules' seconds, the slowest first: where a lane's time goes."""
    for lane in sorted({p.lane for p in LANES}):
        phases = [p for p in LANES if p.lane == lane]
        busy = sum(p.stop - p.start for p in phases)
        e2e = sum(p.stop - p.start for p in phases if in_e2e_dir(p.test))
        terminalreporter.write_line(
            f"lane {lane}: {len({p.test for p in phases})} tests, {busy:.0f} s in tests "
            f"({e2e:.0f} s e2e), last ended {max(p.stop for p in phases) - T0:.0f} s after start")
    modules: dict[tuple[str, str], float] = {}
    for p in LANES:
        if in_e2e_dir(p.test):
            key = (p.lane, p.test.split("::")[0])
            modules[key] = modules.get(key, 0.0) + p.stop - p.start
    for (lane, module), s in sorted(modules.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  {s:6.0f} s  {lane}  {module}")


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """A randomly initialised 2-layer char-level Qwen2 model (fast; nothing learned)."""
    from transformers import AutoModelForCausalLM

    from areal_ray.task.tiny_model import TinyModelSpec, qwen2_config
    from areal_ray.task.tokenizer import save_char_tokenizer

    out = tmp_path_factory.mktemp("random_model")
    tok = save_char_tokenizer(out)
    torch.manual_seed(0)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2)
    AutoModelForCausalLM.from_config(qwen2_config(spec, tok)).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store with its tables created (~1.5 s of migrations)."""
    import mlflow
    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(autouse=True)
def _migrated_mlflow_store(request):
    """The e2e tests point their jobs' MLflow at tmp_path/mlflow.db: it starts as a copy
    of the migrated empty store, so each test's store is still its own but MLflow's
    table creation runs once per session, not once per job."""
    if request.node.get_closest_marker("e2e") and "tmp_path" in request.fixturenames:
        import shutil
        db = request.getfixturevalue("tmp_path") / "mlflow.db"
        if not db.exists():
            shutil.copyfile(request.getfixturevalue("_mlflow_template"), db)


@pytest.fixture
def available_sandbox(monkeypatch) -> str:
    """Model-written code in the test runs under bubblewrap where this machine has it,
    else in the explicit rlimits mode (`reward.sandbox=rlimits`: limits, no isolation):
    tests of what the code does pass on a fresh machine without bubblewrap, and those of
    the isolation itself (tests/reward/test_sandbox.py) skip there, saying why. Calls
    that name no mode take it from $AREAL_SANDBOX; the mode is returned for a job's
    config."""
    from areal_ray.reward import sandbox
    mode = "bwrap" if sandbox.bwrap() else "rlimits"
    monkeypatch.setenv(sandbox.ENV, mode)
    return mode


@pytest.fixture
def one_rank_group():
    """A one-rank gloo process group (FSDP2 and DCP need one), destroyed afterwards."""
    import datetime

    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


# What the session's cluster runs beside the tests, between and during them, made
# cheaper: each xdist worker keeps one for the whole run (~35 min), and in a full run
# their own processes used ~715 CPU-seconds of the 2 cores (the Serve controller's loop,
# the log monitor, the dashboard agent, the GCS), about 16% of the suite. Measured on an
# idle cluster with one Serve app: 9.2 CPU-s a minute as Ray ships, 5.7 with these.
# - No metrics collection: every process exports Ray's metrics to the agent, which
#   serves Prometheus; nothing on this cluster scrapes them (the export is checked on
#   `head_cluster`, by tests/jobs/test_submit.py). The GCS, agent and workers idle less.
# - The Serve controller's loop every 0.5 s, not 0.1 s: it reconciles every app on each
#   turn; autoscaling delays are measured in seconds, not turns.
# - The log monitor lists the log directory every 0.5 s, not on every 0.1 s turn (Ray
#   does that by itself past 1,000 files); new lines are still read every turn.
# - The agent's process report every 30 s, not 5 s (the dashboard's node view: read by
#   nothing here; the memory monitor that kills workers is the raylet's own).
QUIET_CLUSTER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                     "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                     "REPORTER_UPDATE_INTERVAL_MS": "30000"}
QUIET_SYSTEM_CONFIG = {"enable_metrics_collection": False}


@pytest.fixture(scope="session")
def ray_cluster():
    """A private local cluster shared by every test that needs Ray (started once), with
    its dashboard and the workers' environment of a cluster the job starts itself
    (areal_ray.cluster.system_config.local_worker_env), quieter in the background
    (QUIET_CLUSTER_ENV: in the environment its processes start with, not this one's,
    so `head_cluster` is started as Ray ships)."""
    import ray

    from areal_ray.cluster.head import free_ports
    from areal_ray.cluster.system_config import local_worker_env
    (port,) = free_ports(1)
    with pytest.MonkeyPatch.context() as env:
        for k, v in QUIET_CLUSTER_ENV.items():
            env.setenv(k, v)
        ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
                 dashboard_port=port, runtime_env={"env_vars": local_worker_env(str(REPO), port)},
                 logging_level="WARNING", _system_config=QUIET_SYSTEM_CONFIG)
    from ray.data import DataContext
    DataContext.get_current().enable_progress_bars = False
    yield ray
    from ray import serve
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """The committed, warm-started tiny model (built here if it is missing)."""
    from areal_ray.run.job import resolve_model
    os.chdir(REPO)
    return resolve_model("artifacts/tiny")


@pytest.fixture(scope="session")
def tools_model() -> str:
    """The committed tool-use model of conf/tools.yaml (built here if it is missing)."""
    from areal_ray.run.job import resolve_model
    os.chdir(REPO)
    return resolve_model("artifacts/tiny-tools")


@pytest.fixture(scope="session")
def head_cluster(tmp_path_factory):
    """A separate cluster started the way users start one (`ray start --head`), with
    the dashboard (job server) and a metrics export port. Its own process group, so
    tearing it down cannot touch the session's cluster (`ray stop` would stop both).
    One for the session, as a user's cluster outlives their jobs: the modules that
    submit to it, kill a job on it and attach notebooks to it take turns (each start
    cost ~7 s, and its first job Serve's and Ray Data's start-up again)."""
    from areal_ray.cluster.head import start_head
    head = start_head(tmp_path_factory.mktemp("head") / "ray_start.log",
                      extra_env={"RAY_metrics_report_interval_ms": "2000"})
    yield {"gcs_address": head.gcs_address, "dashboard_url": head.dashboard_url,
           "metrics_url": head.metrics_url, "env": head.env}
    head.stop()
