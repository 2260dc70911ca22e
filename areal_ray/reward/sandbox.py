"""Run untrusted programs (model-written code) isolated from the host, with hard limits.

With bubblewrap (`bwrap`, Debian package `bubblewrap`) on the machine, every run gets:
  * new PID, network, IPC, UTS and cgroup namespaces: no network at all (not even the
    host's loopback), no view of host processes;
  * a read-only root holding only /usr, /lib, /bin (the system Python runs the code),
    a private writable /tmp of `tmpfs_mb` and nothing else writable; the program is
    mounted read-only;
  * an empty environment, an unprivileged uid (nobody), a new session (no terminal);
  * rlimits: CPU seconds, address space (memory), processes, file size, open files;
  * a wall-clock limit and an output limit enforced by the parent, which then kills
    the sandbox; bwrap runs as PID 1 of the namespace with `--die-with-parent`, so
    everything the program started dies with it.
Without bwrap it falls back to rlimits + a new session killed as a group, and says so
(`isolation() == "rlimits-only"`, logged once): no network or filesystem isolation.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
NOBODY = 65534
_warned = False


@dataclass
class Limits:
    wall_s: float = 4.0
    cpu_s: int = 2
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 1 << 20
    tmpfs_mb: int = 16


@dataclass
class RunResult:
    returncode: int | None
    stdout: str
    stderr: str
    reason: str  # "ok", "exit N", "timeout", "timeout (CPU time limit)", "output limit", "killed by SIGSEGV", ...


def bwrap() -> str | None:
    return shutil.which("bwrap")


def isolation() -> str:
    return "bwrap" if bwrap() else "rlimits-only"


def _python() -> tuple[str, str]:
    """The interpreter for untrusted code and the prefix to mount for it.

    The system interpreter when there is one: it lives entirely under /usr, which the
    sandbox mounts anyway, and untrusted code needs no more than the standard library.
    """
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3", "/usr"
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _set_limits(limits: Limits, drop_to_nobody: bool):
    def apply() -> None:
        os.setsid()
        mem = limits.memory_mb << 20
        for res, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, limits.max_file_bytes),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (val, val))
        # CPU time: the soft limit sends SIGXCPU (reported as a timeout); the hard one,
        # a second later, SIGKILLs a program that catches it. With soft == hard the
        # kernel sends SIGKILL at once, indistinguishable from any other kill.
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        if drop_to_nobody:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        # After the uid drop, so that the process count is the unprivileged user's.
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    return apply


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
    """Run `code` as a Python program with `stdin`; never raises for what the code does."""
    global _warned
    limits = limits or Limits()
    with tempfile.TemporaryDirectory(prefix="areal-sandbox-") as prog_dir:
        Path(prog_dir, "main.py").write_text(code)
        os.chmod(prog_dir, 0o755)
        if bwrap():
            argv, drop = _bwrap_argv(prog_dir, limits), False
        else:
            if not _warned:
                logger.warning("bubblewrap (bwrap) not found: code runs with rlimits only, "
                               "without network or filesystem isolation")
                _warned = True
            exe, _ = _python()
            argv, drop = [exe, "-I", str(Path(prog_dir, "main.py"))], os.geteuid() == 0
        return _run(argv, stdin, limits, cwd=prog_dir, drop=drop)


def _run(argv: list[str], stdin: str, limits: Limits, cwd: str, drop: bool) -> RunResult:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=cwd,
                                preexec_fn=_set_limits(limits, drop), env={"PATH": "/usr/bin:/bin"})
        reason = None
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        deadline = time.monotonic() + limits.wall_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                reason = "timeout"
                break
            if os.fstat(out.fileno()).st_size > limits.max_output_bytes:
                reason = "output limit"
                break
            time.sleep(0.005)
        if reason is not None:
            _kill_group(proc)
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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
