"""Run untrusted programs (model-written code) isolated from the host, with hard limits.

Isolation is bubblewrap's (`bwrap`, Debian package `bubblewrap`). Every run gets:
  * new PID, network, IPC, UTS and cgroup namespaces: no network at all (not even the
    host's loopback), no view of host processes;
  * a read-only root holding only /usr, /lib, /bin (the system Python runs the code),
    a private writable /tmp of `tmpfs_mb` and nothing else writable; the program is
    mounted read-only;
  * an empty environment, an unprivileged uid (nobody), a new session (no terminal);
  * rlimits: CPU seconds, address space (memory), processes, file size, open files;
  * a wall-clock limit and an output limit enforced by the parent, which then kills
    the sandbox; bwrap runs as PID 1 of the namespace with `--die-with-parent`, so
    everything the program started dies with it, and with the caller.

Without isolation the sandbox fails closed: `SandboxUnavailable`, before anything
runs. The mode (`Limits.sandbox`, the config's `reward.sandbox`) says what a run needs:
  auto     the isolation this machine has, bubblewrap today; refused without it;
  bwrap    bubblewrap; refused without it;
  rlimits  no isolation, an explicit opt-in: the rlimits, the uid drop (as root) and
           the limits of the parent only; the program sees the host's network and
           files. It runs under a reaper (reaper.py) that kills every process it
           started when it ends, setsid() ones included.
A Limits not told its mode takes $AREAL_SANDBOX, else auto. `check_sandbox(cfg)`
refuses a job whose config runs model-written code on a machine without the
isolation it asks for, before Ray starts.

stdin is a file, not a pipe: a program that never reads it cannot hold the parent
before the wall-clock limit starts counting.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from areal_ray.cluster.ownership import sandbox_dir_prefix
from areal_ray.config.reward import SandboxMode
from areal_ray.config.section import ConfigError
from areal_ray.reward.reaper import children

logger = logging.getLogger(__name__)
NOBODY = 65534
ENV = "AREAL_SANDBOX"
BWRAP = "bwrap"  # the bubblewrap program: a name looked up on PATH, or a path
REAPER = str(Path(__file__).with_name("reaper.py"))
STOP_GRACE_S = 2.0  # how long a stopped run gets to end its processes
_warned = False


class SandboxUnavailable(ConfigError):
    """The isolation that model-written code needs is missing or broken here."""


def default_mode() -> str:
    """The mode of a run not told one: $AREAL_SANDBOX, else auto (fails closed)."""
    return os.environ.get(ENV) or SandboxMode.auto.value


@dataclass
class Limits:
    wall_s: float = 4.0
    cpu_s: int = 2
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 1 << 20
    tmpfs_mb: int = 16
    sandbox: str = field(default_factory=default_mode)  # a SandboxMode value


@dataclass
class RunResult:
    returncode: int | None
    stdout: str
    stderr: str
    reason: str  # "ok", "exit N", "timeout", "timeout (CPU time limit)", "output limit", "killed by SIGSEGV", ...


def bwrap() -> str | None:
    return shutil.which(BWRAP)


def missing_isolation(mode: str) -> str:
    return (f"model-written code must run isolated (reward.sandbox={mode}), and bubblewrap "
            f"(bwrap) is not installed: install the Debian package bubblewrap "
            f"(apt-get install bubblewrap), or set reward.sandbox=rlimits to run it "
            f"without network or filesystem isolation (resource limits only)")


def isolation(mode: str | None = None) -> str:
    """What a run in `mode` (default: `default_mode()`) gets here: "bwrap" or
    "rlimits-only"; `SandboxUnavailable` where the mode needs isolation this machine
    lacks."""
    mode = mode or default_mode()
    if mode not in SandboxMode.values():
        raise ConfigError(f"sandbox mode {mode!r} is not one of {SandboxMode.values()}")
    if mode == SandboxMode.rlimits:
        return "rlimits-only"
    if bwrap() is None:
        raise SandboxUnavailable(missing_isolation(mode))
    return "bwrap"


def _python() -> tuple[str, str]:
    """The interpreter for untrusted code and the prefix to mount for it.

    The system interpreter when there is one: it lives entirely under /usr, which the
    sandbox mounts anyway, and untrusted code needs no more than the standard library.
    """
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3", "/usr"
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _rlimits(limits: Limits) -> list[tuple[str, int, int]]:
    """The program's rlimits, but the process count (set after any uid drop)."""
    mem = limits.memory_mb << 20
    return [("RLIMIT_AS", mem, mem), ("RLIMIT_FSIZE", limits.max_file_bytes, limits.max_file_bytes),
            ("RLIMIT_NOFILE", 64, 64), ("RLIMIT_CORE", 0, 0),
            # CPU time: the soft limit sends SIGXCPU (reported as a timeout); the hard
            # one, a second later, SIGKILLs a program that catches it. With soft == hard
            # the kernel sends SIGKILL at once, indistinguishable from any other kill.
            ("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1)]


def _bwrap_limits(limits: Limits):
    """bwrap's preexec: a new session and the rlimits, which the program inherits."""
    def apply() -> None:
        os.setsid()
        for name, soft, hard in _rlimits(limits):
            resource.setrlimit(getattr(resource, name), (soft, hard))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    return apply


def _reaper_argv(prog_dir: str, limits: Limits) -> list[str]:
    """The program under reaper.py, which sets its rlimits, drops root to nobody and
    kills whatever it leaves behind."""
    exe, _ = _python()
    spec = {"rlimits": _rlimits(limits), "nproc": limits.max_processes,
            "drop_to": NOBODY if os.geteuid() == 0 else None, "parent": os.getpid()}
    return [sys.executable, "-I", "-S", REAPER, json.dumps(spec),
            exe, "-I", str(Path(prog_dir, "main.py"))]


def _bwrap_argv(prog_dir: str, limits: Limits) -> list[str]:
    exe, prefix = _python()
    argv = [bwrap(), "--die-with-parent", "--new-session", "--clearenv"]
    if os.geteuid() == 0:
        # No user namespace: inside one, a process that is root outside is exempt from
        # RLIMIT_NPROC. Instead setpriv drops to an unprivileged uid before exec.
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                 "--unshare-cgroup-try"]
        drop = ["/usr/bin/setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"]
    else:
        argv += ["--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        drop = []
    for path in ("/usr", "/lib", "/lib64", "/bin", "/etc/alternatives"):
        argv += ["--ro-bind-try", path, path]
    if prefix != "/usr":
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/tmp",
             "--ro-bind", prog_dir, "/sandbox", "--remount-ro", "/", "--chdir", "/tmp",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
             "--", *drop, exe, "-I", "/sandbox/main.py"]
    return argv


def run_python(code: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
    """Run `code` as a Python program with `stdin`; never raises for what the code does.
    `SandboxUnavailable`, before anything runs, where `limits.sandbox` needs isolation
    this machine lacks."""
    limits = limits or Limits()
    isolated = isolation(limits.sandbox) == "bwrap"
    if not isolated:
        _warn_once()
    # Removed when the check ends; named with this pid for the sweep of a killed
    # reward process's dirs (ownership.stale_sandbox_dirs).
    with tempfile.TemporaryDirectory(prefix=sandbox_dir_prefix(os.getpid())) as prog_dir:
        Path(prog_dir, "main.py").write_text(code)
        os.chmod(prog_dir, 0o755)
        if isolated:
            return _run(_bwrap_argv(prog_dir, limits), stdin, limits, prog_dir,
                        preexec=_bwrap_limits(limits), reaped=False)
        return _run(_reaper_argv(prog_dir, limits), stdin, limits, prog_dir,
                    preexec=None, reaped=True)


def _warn_once() -> None:
    global _warned
    if not _warned:
        logger.warning("reward.sandbox=rlimits: model-written code runs without network or "
                       "filesystem isolation (resource limits only)")
        _warned = True


def _run(argv: list[str], stdin: str, limits: Limits, cwd: str, preexec, reaped: bool) -> RunResult:
    with tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err:
        inp.write(stdin.encode())
        inp.seek(0)
        proc = subprocess.Popen(argv, stdin=inp, stdout=out, stderr=err, cwd=cwd,
                                preexec_fn=preexec, start_new_session=preexec is None,
                                env={"PATH": "/usr/bin:/bin"})
        deadline = time.monotonic() + limits.wall_s
        reason = None
        while not _exited(proc):
            if time.monotonic() > deadline:
                reason = "timeout"
                break
            if os.fstat(out.fileno()).st_size > limits.max_output_bytes:
                reason = "output limit"
                break
            time.sleep(0.005)
        _end(proc, reaped)
        out.seek(0)
        err.seek(0)
        stdout = out.read(limits.max_output_bytes + 1)
        if len(stdout) >= limits.max_output_bytes:  # RLIMIT_FSIZE stops writes right there
            reason = reason or "output limit"
        code = proc.returncode
        if reason is None:
            reason = exit_reason(code)
        return RunResult(code, stdout[: limits.max_output_bytes].decode(errors="replace"),
                         err.read(64 << 10).decode(errors="replace"), reason)


def exit_reason(code: int) -> str:
    """Why a sandboxed program ended by itself or by a kernel limit (the wall and output
    limits are ours, named where we enforce them). The CPU limit ends a program with
    SIGXCPU, or with SIGKILL one CPU-second later (the hard limit) when SIGXCPU did not
    end it, e.g. when the program ignores it. This process, starved on a busy machine,
    can miss the wall limit until then: so a SIGKILL we did not send is a timeout too.
    No other limit sends one (RLIMIT_AS fails allocations, RLIMIT_FSIZE sends SIGXFSZ);
    a program that SIGKILLs itself also reads as a timeout, which scores the same 0.
    bwrap, as PID 1 of the sandbox, reports a child killed by signal N as 128+N."""
    sig = -code if code < 0 else (code - 128 if code > 128 else 0)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return "timeout (CPU time limit)"
    if code == 0:
        return "ok"
    return f"killed by {signal.Signals(sig).name}" if sig else f"exit {code}"


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the run's process has ended, without reaping it: until it is reaped its
    pid, the id of its process group, cannot be reused, so the group can be killed."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _end(proc: subprocess.Popen, reaped: bool) -> None:
    """Nothing the run started outlives the call. A reaper still running is asked to
    stop (SIGTERM): it kills the program's processes, some of which may have left its
    process group. A bwrap still running has its PID namespace killed: the kernel ends
    every process in it before its init is gone, and bwrap exits after its init. Each
    gets STOP_GRACE_S; then the group is killed and the run's process reaped."""
    if not _exited(proc):
        for pid in [proc.pid] if reaped else children(proc.pid):
            try:
                os.kill(pid, signal.SIGTERM if reaped else signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while not _exited(proc) and time.monotonic() < deadline:
            time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def probe(mode: str) -> str:
    """The isolation a run in `mode` gets here, once a program has run in it: bwrap may
    be installed and still unable to create its namespaces (e.g. in a container
    without user namespaces). `SandboxUnavailable` saying why otherwise."""
    got = isolation(mode)
    res = run_python("print(6 * 7)", limits=Limits(wall_s=30.0, sandbox=mode))
    if res.reason != "ok" or res.stdout.strip() != "42":
        detail = (res.stderr.strip().splitlines() or [res.reason])[-1][:200]
        hint = ("; bubblewrap needs unprivileged user namespaces, or root with CAP_SYS_ADMIN "
                "(set reward.sandbox=rlimits to run without isolation)") if got == "bwrap" else ""
        raise SandboxUnavailable(f"the sandbox ({got}, reward.sandbox={mode}) cannot run a "
                                 f"program on this machine: {detail}{hint}")
    return got


CODE_SCAN_ROWS = 1000  # rows of a dataset looked at for verifier "code" before the job


def sandbox_users(cfg) -> list[str]:
    """What in `cfg` runs model-written code: the python tool, and the built-in code
    rewards when a dataset's first CODE_SCAN_ROWS rows name verifier "code" (a later
    code row still finds the sandbox closed, at its check)."""
    from areal_ray.reward.registry import BUILTIN
    users = []
    if "python" in ((cfg.rollout.workflow_kwargs or {}).get("tools") or ()):
        users.append("the python tool (rollout.workflow_kwargs.tools)")
    if cfg.reward.checkers.get("code", BUILTIN["code"]) == BUILTIN["code"]:
        key = next((k for k in ("train_path", "eval_path")
                    if getattr(cfg.task, k) and _has_code_rows(getattr(cfg.task, k))), None)
        if key:
            users.append(f"code rewards (task.{key} has rows with verifier 'code')")
    return users


def _has_code_rows(path: str) -> bool:
    from areal_ray.data.sources import iter_rows
    try:
        return any(isinstance(row, dict) and row.get("verifier") == "code"
                   for _, row in islice(iter_rows(path), CODE_SCAN_ROWS))
    except (OSError, ValueError):  # the job's own reading of the dataset says what is wrong
        return False


def check_sandbox(cfg) -> str | None:
    """Before the job starts anything: where `cfg` runs model-written code, the mode it
    asks for (`reward.sandbox`) works here. Returns the isolation runs get, None when
    nothing in the config runs code; `SandboxUnavailable` (a ConfigError) naming what
    needs the sandbox and what to install otherwise."""
    users = sandbox_users(cfg)
    if not users:
        return None
    try:
        return probe(cfg.reward.sandbox)
    except SandboxUnavailable as e:
        raise SandboxUnavailable(f"{' and '.join(users)} run model-written code: {e}") from None
