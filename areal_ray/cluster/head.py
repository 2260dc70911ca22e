"""A `ray start --head` cluster on this machine, started and stopped by a program: the
way Ray users run jobs (`ray start` once, then `ray job submit`), for the tests of
submission and clean-up and for the start-up benchmark.

It runs in its own session (process group), so stopping it cannot touch another
cluster on the host, as `ray stop` would. Every port is chosen free up front.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PORTS = ("gcs", "dashboard", "metrics", "client", "agent", "agent_grpc", "runtime_env")


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: the sockets stay bound until all are chosen (binding and
    closing one at a time let the OS hand out the same port twice, and `ray start`
    refused two components on one port)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def session_processes(sid: int) -> dict[int, str]:
    """{pid: name} of the live (not zombie) processes of session `sid` (/proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if rest[0] != "Z" and int(rest[3]) == sid:  # fields after the name: state ppid pgrp session
            found[int(entry.name)] = name
    return found


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except urllib.error.HTTPError:  # 401 without the token: the server is up
        return True
    except OSError:
        return False


@dataclass
class HeadCluster:
    proc: subprocess.Popen
    ports: dict[str, int]
    env: dict[str, str]  # what a `ray` CLI call or a job needs to reach this cluster

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.ports['gcs']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def stop(self) -> None:
        stop_session(self.proc)


def stop_session(proc: subprocess.Popen) -> None:
    """Stop the node `ray start --block` runs in session `proc.pid`: SIGTERM to its
    raylet first, while the GCS still answers: it stops its workers (each in its own
    process group, so killpg cannot reach them; they stay in the session) and exits in
    well under a second. Then the rest of the session (GCS, dashboard, monitor, agents,
    `ray start`) is killed. (SIGTERM to the whole group at once made the raylet take
    ~10 s, left an idle worker behind, and the GCS and `ray start` outlived it.)"""
    for pid, name in session_processes(proc.pid).items():
        if name == "raylet":
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 20
    while time.time() < deadline and any(
            name == "raylet" or name.startswith("ray::")
            for name in session_processes(proc.pid).values()):
        proc.poll()  # reap our own child
        time.sleep(0.25)
    for pid in session_processes(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


STARTED = "Ray runtime started."  # what `ray start` prints once its node has registered


def start_head(log: Path, num_cpus: int = 4, timeout_s: float = 120.0,
               extra_env: dict[str, str] | None = None, tries: int = 2,
               args: tuple[str, ...] = ()) -> HeadCluster:
    """`ray start --head --block` with the dashboard (job server) and a metrics export
    port, in token auth mode; returns once `ray start` says its node registered and both
    answer. The dashboard can answer before that: `ray start` waits a fixed 30 s for its
    raylet to register with the GCS and then tears the whole node down, which it did on
    a saturated 2-core machine. A start that ends so is tried again, `tries` in all,
    on new ports. `args`: more `ray start` options (--resources, --labels)."""
    return _tried(lambda: _start_head(log, num_cpus, timeout_s, extra_env, args), tries)


def _tried(start, tries: int):
    """`start()`, again on a RuntimeError (a failed start), `tries` times in all."""
    for attempt in range(1, tries + 1):
        try:
            return start()
        except RuntimeError:
            if attempt == tries:
                raise


def _start_head(log: Path, num_cpus: int, timeout_s: float,
                extra_env: dict[str, str] | None, args: tuple[str, ...]) -> HeadCluster:
    ports = dict(zip(PORTS, free_ports(len(PORTS))))
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
               TOKENIZERS_PARALLELISM="false",
               RAY_AUTH_MODE="token",  # clients send ~/.ray/auth_token only in token mode
               # where the state API is (Ray Train's PlacementGroupCleaner asks it): this
               # cluster's dashboard, not whichever cluster on the host auto-detection finds
               RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{ports['dashboard']}", **(extra_env or {}))
    env.pop("RAY_ADDRESS", None)
    # token mode: `ray start` refuses to start without ~/.ray/auth_token (README's first
    # step makes it); made here when missing, as `ray.init` does for a local cluster
    subprocess.run([str(bindir / "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    proc = subprocess.Popen(
        [str(bindir / "ray"), "start", "--head", "--block", f"--num-cpus={num_cpus}",
         f"--port={ports['gcs']}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={ports['dashboard']}", f"--metrics-export-port={ports['metrics']}",
         f"--ray-client-server-port={ports['client']}",
         f"--dashboard-agent-listen-port={ports['agent']}",
         f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
         f"--runtime-env-agent-port={ports['runtime_env']}", *args],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    head = HeadCluster(proc, ports, env)
    deadline = time.time() + timeout_s
    raylet = None
    while not (STARTED in log.read_text() and _answers(f"{head.dashboard_url}/api/version")
               and _answers(head.metrics_url)):
        raylet = raylet or raylet_of(proc)
        died = raylet is not None and raylet_of(proc) is None  # see join_node
        if died or proc.poll() is not None or time.time() > deadline:
            head.stop()
            raise RuntimeError(f"ray start --head failed{' (its raylet died)' if died else ''}:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(1)
    return head


def raylet_of(proc: subprocess.Popen) -> int | None:
    """The pid of the raylet `ray start` runs in session `proc.pid`, if one runs."""
    return next((pid for pid, name in session_processes(proc.pid).items() if name == "raylet"), None)


# A raylet started beside a busy head on a saturated machine took longer than Ray's
# 30 s to register. (Its fixed 15 s wait for the dashboard agent's port files is not
# configurable: a raylet that dies of it is a failed start, tried again.)
SLOW_MACHINE_ENV = {"RAY_raylet_start_wait_time_s": "120"}
JOIN_PORTS = ("node-manager", "object-manager", "metrics-export", "dashboard-agent-listen",
              "dashboard-agent-grpc", "runtime-env-agent")


@dataclass
class JoinedNode:
    """A second raylet on this machine, joined to a head: a node of its own to Ray (its
    own node id and resources; the head's IP)."""
    proc: subprocess.Popen

    def raylet_pid(self) -> int | None:
        return raylet_of(self.proc)

    def stop(self) -> None:
        stop_session(self.proc)

    def kill(self) -> None:
        """The node lost as a machine is: SIGKILL to every process of its session at
        once (the raylet, its workers and agents, `ray start`), nothing told first."""
        for pid in session_processes(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


def join_node(head: HeadCluster, log: Path, num_cpus: int, args: tuple[str, ...] = (),
              timeout_s: float = 180.0, tries: int = 5) -> JoinedNode:
    """`ray start --address --block` of another raylet on this machine, in a session of
    its own, every port of its own chosen free; returns once `ray start` says it joined.
    A raylet that dies while starting (it waits a fixed 15 s for its dashboard agent's
    port file, which a saturated machine missed; `ray start` noticed only minutes
    later) is a failed start, tried again, `tries` in all."""
    return _tried(lambda: _join_node(head, log, num_cpus, args, timeout_s), tries)


def _join_node(head: HeadCluster, log: Path, num_cpus: int, args: tuple[str, ...],
               timeout_s: float) -> JoinedNode:
    ports = [f"--{name}-port={port}" for name, port in zip(JOIN_PORTS, free_ports(len(JOIN_PORTS)))]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", f"--address={head.gcs_address}",
         "--block", f"--num-cpus={num_cpus}", *ports, *args],
        env=dict(head.env, **SLOW_MACHINE_ENV), stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    node = JoinedNode(proc)
    deadline = time.time() + timeout_s
    raylet = None
    while STARTED not in log.read_text():
        raylet = raylet or raylet_of(proc)
        died = raylet is not None and raylet_of(proc) is None
        if died or proc.poll() is not None or time.time() > deadline:
            node.stop()
            raise RuntimeError(f"ray start --address failed{' (its raylet died)' if died else ''}:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(1)
    return node
