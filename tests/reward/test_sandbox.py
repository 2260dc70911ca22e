"""Every limit of the sandbox holds (issue 4): time, CPU, memory, processes, output,
network, file writes, and nothing outliving the call."""

import os
import socket
import subprocess
import time
import uuid

import pytest

from areal_ray.reward import sandbox
from areal_ray.reward.sandbox import Limits, run_python

needs_bwrap = pytest.mark.skipif(sandbox.bwrap() is None,
                                 reason="bubblewrap not installed (.ci/run installs it)")


def test_runs_a_program_with_stdin():
    res = run_python("print(input()[::-1])", "hello\n")
    assert res.reason == "ok" and res.stdout == "olleh\n"


def test_wall_clock_limit():
    t0 = time.monotonic()
    res = run_python("import time; time.sleep(60)", limits=Limits(wall_s=1.0))
    assert res.reason == "timeout" and time.monotonic() - t0 < 10


def test_cpu_limit_kills_a_busy_loop_before_the_wall_limit():
    res = run_python("while True: pass", limits=Limits(wall_s=20.0, cpu_s=1))
    assert res.reason == "timeout (CPU time limit)"  # SIGXCPU at the soft limit


def test_a_program_that_ignores_the_cpu_signal_is_killed_a_second_later_as_a_timeout():
    """The hard CPU limit's SIGKILL, which is also what a parent too starved to see the
    wall limit first gets: a timeout either way, deterministically (the wall limit is
    out of reach here)."""
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    res = run_python(code, limits=Limits(wall_s=20.0, cpu_s=1))
    assert res.reason == "timeout (CPU time limit)"


def test_memory_limit():
    res = run_python("x = bytearray(1 << 30); print('allocated')", limits=Limits(memory_mb=256))
    assert res.reason != "ok" and "allocated" not in res.stdout and "MemoryError" in res.stderr


def test_process_limit_stops_a_fork_bomb():
    code = "import os\nfor _ in range(64):\n    os.fork()\nprint('done')"
    res = run_python(code, limits=Limits(max_processes=16, wall_s=10))
    assert res.reason != "ok" and "BlockingIOError" in res.stderr


def test_output_limit():
    res = run_python("print('x' * 10_000_000)", limits=Limits(max_output_bytes=1 << 16))
    assert res.reason == "output limit" and len(res.stdout) <= 1 << 16


@needs_bwrap
def test_no_network_not_even_the_hosts_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\nexcept OSError as e:\n    print('blocked', e)")
    try:
        res = run_python(code)
    finally:
        server.close()
    assert res.reason == "ok" and res.stdout.startswith("blocked")


@needs_bwrap
def test_no_writes_outside_the_sandbox(tmp_path):
    os.chmod(tmp_path, 0o777)
    target = tmp_path / "escaped.txt"
    code = (f"for p in ['{target}', '/etc/escaped.txt', '/escaped.txt']:\n"
            "    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n"
            "    except OSError as e:\n        print('refused', p)\n"
            "open('/tmp/scratch', 'w').write('ok')\nprint(open('/tmp/scratch').read())")
    res = run_python(code)
    assert not target.exists() and not os.path.exists("/etc/escaped.txt")
    assert res.stdout.count("refused") == 3 and res.stdout.strip().endswith("ok")


@needs_bwrap
def test_runs_as_an_unprivileged_user_with_an_empty_environment():
    res = run_python("import os; print(os.getuid(), sorted(os.environ))")
    uid, env = res.stdout.split(" ", 1)
    assert int(uid) != 0 and "AREAL" not in env


def test_nothing_outlives_the_call():
    marker = f"areal-orphan-{uuid.uuid4().hex}"
    code = ("import os, subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'],"
            " start_new_session=True)\nprint('spawned')")
    res = run_python(code, limits=Limits(wall_s=5))
    assert res.stdout.strip() == "spawned"
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert marker not in ps


def test_fallback_without_bwrap_still_bounds_time_and_output(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap", lambda: None)
    assert sandbox.isolation() == "rlimits-only"
    assert run_python("import time; time.sleep(60)", limits=Limits(wall_s=1)).reason == "timeout"
    assert run_python("print('x' * 10_000_000)",
                      limits=Limits(max_output_bytes=1 << 16)).reason == "output limit"
    assert run_python("print(input())", "hi\n").stdout == "hi\n"


@pytest.mark.parametrize("code, reason", [
    (128 + 24, "timeout (CPU time limit)"),  # bwrap: the child got SIGXCPU (soft limit)
    (-24, "timeout (CPU time limit)"),
    (128 + 9, "timeout (CPU time limit)"),   # SIGKILL at the hard limit
    (-9, "timeout (CPU time limit)"),
    (0, "ok"),
    (3, "exit 3"),
    (128 + 11, "killed by SIGSEGV"),
    (-6, "killed by SIGABRT"),
])
def test_exit_reasons(code, reason):
    assert sandbox.exit_reason(code) == reason

