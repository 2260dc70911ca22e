"""The parent of a program run without isolation (sandbox mode `rlimits`): it outlives
the program and kills every process the program started.

Without a PID namespace, a process that calls setsid() leaves the program's session
and process group, so killing those misses it. This process makes itself a child
subreaper (prctl PR_SET_CHILD_SUBREAPER): an orphan anywhere below it is re-parented
to it rather than to init. When the program has ended, or when the sandbox asks
(SIGTERM, at the wall or output limit), it kills its children; their children are then
its own, and it goes on until none is left. It keeps the caller's uid while the
program is dropped to nobody when the caller is root, so the program cannot kill it
(a caller that is not root shares its uid with the program: a program that kills the
reaper first can leave orphans; bwrap's PID namespace has no such gap). The
program's rlimits are set in the forked child, just before exec.

Run by the sandbox as a script, with the standard library only:
    python -I -S reaper.py LIMITS_JSON PROGRAM [ARGS...]
LIMITS_JSON: {"rlimits": [[name, soft, hard], ...], "drop_to": uid or null,
"nproc": n, "parent": the caller's pid}. The caller's death, like its SIGTERM, stops
the program. Exits with the program's status, 128+N when signal N ended it (as bwrap
reports a child's death).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def children(me: int | None = None) -> list[int]:
    """The children of process `me` (this one by default), from /proc: every thread's
    list, or a scan of every process's parent where the kernel keeps no lists."""
    me = os.getpid() if me is None else me
    try:
        kids: list[int] = []
        for task in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
        return kids
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{me}"):
            return []
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                kids.append(int(name))
    return kids


def kill_descendants() -> None:
    """SIGKILL every child and reap it, until no child is left: a killed process's
    children become ours (we are their subreaper) and are killed in the next round."""
    while True:
        kids = children()
        if not kids:
            return
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def status_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def exec_program(argv: list[str], spec: dict) -> None:
    """In the forked child: a new session, the rlimits, the uid drop, then the program."""
    try:
        os.setsid()
        for name, soft, hard in spec["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if spec["drop_to"] is not None:
            os.setgroups([])
            os.setgid(spec["drop_to"])
            os.setuid(spec["drop_to"])
        # After the uid drop, so that the process count is the unprivileged user's.
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
        os.execv(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - the program's stderr says why it never ran
        os.write(2, f"sandbox: cannot start the program: {e}\n".encode())
    os._exit(126)


def main(argv: list[str]) -> int:
    spec, program = json.loads(argv[1]), argv[2:]
    become_subreaper()
    state = {"stopping": False, "pid": None}

    def stop(*_) -> None:
        state["stopping"] = True
        if state["pid"] is not None:
            try:
                os.kill(state["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    # The caller's death (its own deadline killed it) stops the program too.
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != spec["parent"]:  # it died before the line above
        return 128 + signal.SIGTERM
    pid = os.fork()
    if pid == 0:
        exec_program(program, spec)
    state["pid"] = pid
    if state["stopping"]:  # asked to stop between the fork and the line above
        stop()
    _, status = os.waitpid(pid, 0)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # the cleanup below must finish
    kill_descendants()
    return status_code(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
