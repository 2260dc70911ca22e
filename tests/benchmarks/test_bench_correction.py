"""benchmarks/bench_correction.py: its arms' configs, its report on known runs, its
refusals. The benchmark itself is run by hand (docs/benchmarks.md): 27 training runs."""

import pytest

from areal_ray.config import ConfigError, load_config
from benchmarks import bench_correction
from benchmarks.bench_correction import BenchCorrectionConfig, arm_config, check, summarise, summary_line, table

CONF = "conf/bench_correction.yaml"


@pytest.mark.parametrize("arm,engine,mode,loss", [
    ("matched", "", "off", "decoupled_ppo"),
    ("mismatched", "bfloat16", "off", "decoupled_ppo"),
    ("token_tis", "bfloat16", "token_tis", "decoupled_ppo"),
    ("geo_mis", "bfloat16", "geo_mis", "decoupled_ppo"),
    ("icepop", "bfloat16", "icepop", "decoupled_ppo"),
    ("cispo", "bfloat16", "off", "cispo"),
])
def test_an_arm_is_the_base_with_its_engine_dtype_and_correction(tmp_path, arm, engine, mode, loss):
    c = check(load_config(CONF, [], schema=BenchCorrectionConfig))
    cfg = arm_config(c.base, arm, 2, c.mismatch_dtype, tmp_path / arm)
    assert (cfg.rollout.dtype, str(cfg.algo.loss.correction.mode), str(cfg.algo.loss.name)) == (engine, mode, loss)
    assert (cfg.train.seed, cfg.task.seed, cfg.algo.eta, str(cfg.rollout.backend)) == (2, 2, 4, "vllm")
    assert cfg.run.eval_before and cfg.run.eval_after and cfg.run.run_dir == str(tmp_path / arm)


def run(arm, seed, acc, k3=None, masked=None):
    steps = {} if k3 is None else {"mismatch_k3": k3, "mismatch_chi2": 2 * k3, "entropy": 0.5}
    if masked is not None:
        steps["correction_masked_frac"] = masked
    return {"arm": arm, "seed": seed, "eval_accuracy_before": 0.2, "eval_accuracy_after": acc,
            "wall_s": 60.0, "steps": steps}


def test_rows_average_the_seeds_and_compare_with_matched():
    runs = [run("matched", 0, 0.80, 1e-5), run("mismatched", 0, 0.60, 1e-2), run("icepop", 0, 0.78, 1e-2, 0.01),
            run("matched", 1, 0.70, 1e-5), run("mismatched", 1, 0.50, 3e-2), run("icepop", 1, 0.74, 3e-2, 0.03)]
    rows = summarise(runs, ["matched", "mismatched", "icepop"])
    by = {r["arm"]: r for r in rows}
    assert by["matched"]["accuracy_after_mean"] == pytest.approx(0.75)
    assert by["mismatched"]["points_vs_matched"] == pytest.approx(-20.0)
    assert by["icepop"]["points_vs_matched"] == pytest.approx(1.0)
    assert by["mismatched"]["mismatch_k3"] == pytest.approx(2e-2)
    assert by["icepop"]["correction_masked_frac"] == pytest.approx(0.02)
    assert "correction_masked_frac" not in by["mismatched"]  # not recorded: not invented
    lines = table(rows).splitlines()
    assert len(lines) == 2 + 3 and "| icepop | 0.760; 0.780 0.740 | +1.0 |" in lines[4]
    report = {"machine": "m", "mismatch_dtype": "bfloat16", "seeds": [0, 1], "rows": rows,
              "base": {"rollout": {"backend": "vllm"}, "algo": {"eta": 4}, "train": {"steps": 40}}}
    line = summary_line(report)
    assert "mismatched 0.550 (-20.0)" in line and "mismatch k3 2.00e-02/token" in line


@pytest.mark.parametrize("overrides,message", [
    (["arms=[mismatched,icepop]"], "must include matched"),
    (["arms=[matched,bogus]"], "arms must be distinct names"),
    (["seeds=[0,0]"], "seeds must be distinct"),
    (["mismatch_dtype=float32"], "mismatch_dtype must be"),
    (["base.rollout.dtype=bfloat16"], "set the engine's dtype themselves"),
])
def test_bad_bench_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(load_config(CONF, overrides, schema=BenchCorrectionConfig))


def test_bench_main_rejects_a_bad_config_before_running(capsys):
    assert bench_correction.main(["--config", CONF, "arms=[icepop]"]) == 2
    assert "must include matched" in capsys.readouterr().err
