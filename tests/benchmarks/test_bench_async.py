"""The headline benchmark: its report logic on known arms, each objective's arm config,
and the real job on the tiny model (two etas of one objective, a few steps each)."""

import json

import pytest

from areal_ray.config import ConfigError, load_config
from benchmarks import bench_async
from benchmarks.bench_async import BenchAsyncConfig, check, ratios, summary_line, table


def arm(eta, objective, sps, acc, wall=100.0):
    return {"eta": eta, "objective": objective, "steady_samples_per_s": sps,
            "steady_tokens_per_s": 10 * sps, "samples_per_s": sps / 2, "tokens_per_s": 5 * sps,
            "wall_s": wall, "trainer_idle_fraction": 0.5, "rollout_idle_fraction": 0.25,
            "eval_accuracy_after": acc, "max_staleness": eta, "n_samples": 640,
            "output_len_p50": 20.0, "output_len_p99": 90.0, "output_len_max": 96.0}


def test_ratios_are_against_eta0_of_the_same_objective():
    arms = [arm(0, "decoupled", 10.0, 0.80, wall=300), arm(4, "decoupled", 31.0, 0.79, wall=100),
            arm(0, "ppo", 20.0, 0.70), arm(4, "ppo", 30.0, 0.60)]
    ratios(arms)
    assert arms[0]["vs_eta0"]["steady_samples_per_s"] == 1.0
    assert arms[1]["vs_eta0"]["steady_samples_per_s"] == pytest.approx(3.1)
    assert arms[1]["vs_eta0"]["wall_s"] == pytest.approx(3.0)
    assert arms[1]["accuracy_points_vs_eta0"] == pytest.approx(-1.0)
    assert arms[3]["vs_eta0"]["steady_samples_per_s"] == pytest.approx(1.5)
    assert arms[3]["accuracy_points_vs_eta0"] == pytest.approx(-10.0)
    report = {"machine": "m", "headline_objective": "decoupled", "arms": arms}
    line = summary_line(report)
    assert "eta 4 vs 0 (decoupled): 3.10x" in line and "ppo accuracy by eta 0:0.700 4:0.600" in line
    rows = table(report).splitlines()
    arms[2]["rollout_idle_fraction"] = None
    assert "| n/a |" in table(report).splitlines()[4]
    assert len(rows) == 2 + len(arms) and "| 4 | decoupled | 31.0 | 3.10x |" in rows[3]


@pytest.mark.parametrize("overrides,message", [
    (["etas=[1,2]"], "etas must include 0"),
    (["etas=[0,0]"], "distinct"),
    (["objectives=[grpo]"], "objectives must be"),
    (["base.algo.batch_groups=0"], "algo.batch_groups"),
])
def test_bad_bench_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(load_config("conf/bench_async.yaml", overrides, schema=BenchAsyncConfig))


def test_bench_main_rejects_a_bad_config_before_running(capsys):
    assert bench_async.main(["--config", "conf/bench_async.yaml", "etas=[2]"]) == 2
    assert "etas must include 0" in capsys.readouterr().err


@pytest.mark.parametrize("objective,decoupled", [("decoupled", True), ("ppo", False)])
def test_an_arm_is_the_base_config_with_its_eta_and_objective(tmp_path, objective, decoupled):
    c = load_config("conf/bench_async.yaml", [], schema=BenchAsyncConfig)
    cfg = bench_async.arm_config(c.base, 4, objective, tmp_path / "r")
    assert (cfg.algo.eta, cfg.algo.loss.decoupled, cfg.run.eval_after) == (4, decoupled, True)
    assert cfg.run.name == f"bench-async-eta4-{objective}" and cfg.run.run_dir == str(tmp_path / "r")
    assert c.base.algo.eta != 4 and c.base.algo.loss.decoupled  # each arm is a copy


def test_bench_async_runs_its_arms_into_a_report(ray_cluster, embedded_model, tmp_path, capsys):
    """One arm, plain PPO at eta 0, through the whole bench: its job, report, table,
    plot and summary line. The rest is checked without a job: each eta's and
    objective's arm config (above), the ratios on known arms (above), eta's bound in a
    job (tests/jobs/test_train.py), and two jobs run in one process (test_resume.py's,
    in-process); a second arm here cost ~170 s of the suite for none of these."""
    out = tmp_path / "bench" / "report.json"
    rc = bench_async.main([
        "--config", "conf/bench_async.yaml", "etas=[0]", "objectives=[ppo]", f"out={out}",
        f"base.model.path={embedded_model}", "base.train.steps=3", "base.algo.batch_groups=4",
        "base.rollout.group_size=4", "base.rollout.max_new_tokens=48", "base.task.n_eval=16",
        f"base.run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    assert rc == 0
    report = json.loads(out.read_text())
    arms = report["arms"]
    assert [(a["eta"], a["objective"]) for a in arms] == [(0, "ppo")]
    for a in arms:
        config = json.loads((tmp_path / a["run_dir"] / "config.json").read_text())
        assert config["algo"]["eta"] == a["eta"]
        assert config["algo"]["loss"]["decoupled"] == (a["objective"] == "decoupled")
        assert a["n_samples"] == 3 * 4 * 4  # the same trained samples in every arm
        assert a["max_staleness"] <= a["eta"]
        assert 0 <= a["trainer_idle_fraction"] <= 1 and 0 <= a["eval_accuracy_after"] <= 1
        # three steps may end before two replica load reports (every 2 s) fall inside
        assert a["rollout_idle_fraction"] is None or 0 <= a["rollout_idle_fraction"] <= 1
        assert 0 < a["output_len_p50"] <= a["output_len_max"] <= 48
        sync = next(s for s in arms if s["eta"] == 0 and s["objective"] == a["objective"])
        assert a["vs_eta0"]["steady_samples_per_s"] == pytest.approx(
            a["steady_samples_per_s"] / sync["steady_samples_per_s"])
    assert (tmp_path / "bench" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "bench" / "report.md").read_text().splitlines()) == 2 + 1
    assert report["summary"] in capsys.readouterr().out
