"""bench_start's pure parts: its config checks, the first step it reads from a run, the
commands it launches and the per-arm medians. (The runs themselves are `jobs.train`,
tested end to end elsewhere; a full bench runs 8 jobs.)"""

import json
import os
import subprocess
import sys

import pytest

from areal_ray.config import ConfigError, load_config
from benchmarks import bench_start


@pytest.mark.parametrize("overrides,message", [
    (["modes=[local,cloud]"], "modes must be distinct names"),
    (["modes=[]"], "modes must be distinct names"),
    (["overlap=[true,true]"], "overlap must be distinct"),
    (["repeats=0"], "repeats must be >= 1"),
    (["base.run.ray_address=127.0.0.1:6379"], "base.run.ray_address must be empty"),
])
def test_bad_configs_are_refused(overrides, message):
    c = load_config("conf/bench_start.yaml", overrides, schema=bench_start.BenchStartConfig)
    with pytest.raises(ConfigError, match=message):
        bench_start.check(c)


def test_the_first_step_is_the_first_step_record_not_a_restore(tmp_path):
    assert bench_start.first_step_wall(tmp_path) is None
    (tmp_path / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"event": "restore", "version": 0, "t_wall": 1.0},
        {"step": 0, "version": 1, "t_wall": 5.5}, {"step": 1, "version": 2, "t_wall": 6.0}]))
    assert bench_start.first_step_wall(tmp_path) == 5.5


def test_local_runs_the_job_and_submit_wraps_the_same_job_in_ray_job_submit(tmp_path):
    class Head:
        dashboard_url = "http://127.0.0.1:8265"
    local = bench_start.command("local", tmp_path / "c.yaml", True, tmp_path / "r", "n", None)
    submit = bench_start.command("submit", tmp_path / "c.yaml", False, tmp_path / "r", "n", Head())
    assert local[1:3] == ["-m", "jobs.train"] and "run.overlap_start=true" in local
    assert submit[1:5] == ["job", "submit", "--address", Head.dashboard_url]
    job = submit[submit.index("--") + 1:]
    assert job[1:] == [a.replace("true", "false") for a in local[1:]]


def test_medians_per_arm():
    runs = [{"mode": "local", "overlap": o, "launch_to_first_step_s": v, "first_step_s": v - 10,
             "launch_to_end_s": v + 5} for o, v in [(True, 30), (True, 40), (True, 20), (False, 50)]]
    arms = bench_start.summarize(runs)
    assert arms["local/overlap"] == {"launch_to_first_step_s": 30, "first_step_s": 20,
                                     "launch_to_end_s": 35, "runs": 3}
    assert arms["local/sequential"]["runs"] == 1
    line = bench_start.summary_line({"machine": "m", "repeats": 3, "arms": arms})
    assert "local/overlap: first step 30.0 s after launch (20.0 s in the job)" in line


BUSY = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
        "print('busy done', flush=True)\ntime.sleep({rest})\n")


def test_launch_cpu_counts_what_each_process_spends_after_the_launch_only(tmp_path):
    # one process burns 0.5 CPU-s before the launch and then idles; one started
    # after the launch burns 0.6 CPU-s and lives on so a sample sees all of it. Each
    # runs the interpreter under a name of its own: its role (bench_soak.role).
    for name in ("busy-before", "busy-after"):
        (tmp_path / name).symlink_to(sys.executable)
    before = subprocess.Popen([str(tmp_path / "busy-before"), "-c", BUSY.format(s=0.5, rest=3)],
                              stdout=subprocess.PIPE, text=True)
    assert before.stdout.readline().strip() == "busy done"
    meter = bench_start.LaunchCpu()
    after = subprocess.Popen([str(tmp_path / "busy-after"), "-c", BUSY.format(s=0.6, rest=0.5)],
                             stdout=subprocess.PIPE, text=True)
    assert after.stdout.readline().strip() == "busy done"
    got = meter.stop()
    before.kill(), after.wait(10)
    roles = got["cpu_s_by_process"]
    assert 0.6 <= roles["busy-after"] <= got["cpu_s"]
    assert roles.get("busy-before", 0.0) < 0.2  # its 0.5 s came before the launch
    assert got["cores"] == os.cpu_count() and list(roles.values()) == sorted(roles.values(), reverse=True)
