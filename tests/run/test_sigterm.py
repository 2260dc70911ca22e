"""SIGTERM (`ray job stop`) ends a job through its cleanup: the `finally` blocks run and
the exit status is 143, where Python's default would end the process with none of them."""

import signal
import subprocess
import sys
import time

SCRIPT = r'''
import sys, time
from jobs.cli import run_job

def fn(cfg):
    try:
        print("running", flush=True)
        time.sleep(60)
    finally:
        print("cleaned up", flush=True)

sys.exit(run_job(["run.name=sigterm"], "prog", "a job", fn))
'''


def test_sigterm_runs_the_jobs_cleanup_and_exits_143():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and time.monotonic() - t0 < 30
    assert "cleaned up" in out
    assert "stopped: stopped by SIGTERM (ray job stop)" in err
