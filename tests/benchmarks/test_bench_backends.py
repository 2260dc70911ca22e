"""The backend benchmark: its report logic on known runs, bad configs, and the real job
on the tiny model (one short run; the vLLM run itself is tests/jobs/test_train.py's)."""

import json
from operator import attrgetter

import pytest

from areal_ray.config import ConfigError, load_config
from benchmarks.bench_backends import BenchBackendsConfig, check, main, summarize, summary_line, table


def run(backend, sps, acc, wall):
    return {"backend": backend, "wall_s": wall, "train_s": wall - 30, "samples_per_s": sps,
            "steady_samples_per_s": 2 * sps, "generation_tokens_per_s": 1000.0,
            "rollout_idle_fraction": 0.2, "trainer_idle_fraction": 0.1,
            "eval_accuracy_before": 0.15, "eval_accuracy_after": acc, "max_staleness": 2,
            "n_samples": 2560}


def test_medians_per_backend_and_the_ratio_line():
    runs = [run("hf", 20.0, 0.80, 150), run("vllm", 30.0, 0.78, 120),
            run("hf", 24.0, 0.84, 130), run("vllm", 26.0, 0.82, 140)]
    s = summarize(runs, ["hf", "vllm"])
    assert s["hf"]["samples_per_s"] == 22.0 and s["vllm"]["wall_s"] == 130
    assert s["vllm"]["eval_accuracy_after"] == pytest.approx(0.80) and s["hf"]["runs"] == 2
    report = {"machine": "m", "repeats": 2, "runs": runs, "backends": s}
    line = summary_line(report)
    assert "vllm/hf samples/s 1.27x" in line and "wall 1.08x" in line
    rows = table(report).splitlines()
    assert len(rows) == 2 + 4 and rows[3].startswith("| vllm | 120 | 90 | 30.0 (60.0) |")


@pytest.mark.parametrize("overrides,message", [
    (["backends=[]"], "backends"), (["backends=[hf,tgi]"], "backends"),
    (["backends=[hf,hf]"], "backends"), (["repeats=0"], "repeats")])
def test_bad_configs_are_refused(overrides, message):
    from jobs.cli import job_config
    c = job_config(overrides, "bench_backends", "", BenchBackendsConfig)
    with pytest.raises(ConfigError, match=message):
        check(c)


def test_the_shipped_config_is_the_quickstart(tmp_path):
    from jobs.cli import job_config
    c = check(job_config(["--config", "conf/bench_backends.yaml"], "bench_backends", "",
                         BenchBackendsConfig))
    quick = load_config("conf/quickstart.yaml", [])
    for key in ("algo.eta", "algo.batch_groups", "algo.optim.lr", "train.steps", "train.num_workers",
                "train.seed", "task.seed"):
        assert attrgetter(key)(c.base) == attrgetter(key)(quick), key
    assert (c.base.rollout.group_size, c.base.rollout.max_new_tokens) == \
        (quick.rollout.group_size, quick.rollout.max_new_tokens)


def test_bench_backends_runs_the_real_job(ray_cluster, embedded_model, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["--config", "conf/bench_backends.yaml", "backends=[hf]", "repeats=1",
                 f"out={out}", f"base.model.path={embedded_model}", "base.train.steps=2",
                 "base.algo.batch_groups=2", "base.rollout.group_size=4", "base.task.n_eval=8",
                 f"base.run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]) == 0
    report = json.loads(out.read_text())
    (r,) = report["runs"]
    assert r["backend"] == "hf" and r["n_samples"] == 2 * 2 * 4 and r["max_staleness"] <= 2
    summary = json.loads((next(tmp_path.glob("report-*")) / "hf-0" / "summary.json").read_text())
    assert summary["steps"] == 2
    assert "bench_backends" in capsys.readouterr().out
    assert (tmp_path / "report.md").read_text().startswith("| backend |")
