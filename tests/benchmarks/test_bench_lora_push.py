"""bench_lora_push's report on known arms, and its refusals; the arms themselves are the
real job, which tests/jobs/test_train.py runs with rollout.lora_push=finish on vLLM."""

import pytest

from areal_ray.config import ConfigError, load_config
from benchmarks.bench_lora_push import BenchLoraPushConfig, arm, arm_config, check, compare, summary_line


def steps(push_s, resubmits):
    return [{"push_total_s": p, "push_load_s": p / 2, "resubmits": resubmits} for p in push_s]


def summary(sps, acc, stale):
    return {"wall_s": 100.0, "train_s": 90.0, "steady_samples_per_s": sps, "samples_per_s": sps / 2,
            "eval_accuracy_before": 0.1, "eval_accuracy_after": acc, "mean_staleness": stale,
            "max_staleness": 2, "trainer_idle_fraction": 0.3, "rollout_idle_fraction": None,
            "n_samples": 640}


def test_arms_are_averaged_per_mode_and_the_faster_named():
    arms = [arm("pause", summary(10.0, 0.8, 0.5), steps([0.1, 0.3, 0.2], 4), "a"),
            arm("finish", summary(12.0, 0.7, 1.0), steps([0.05, 0.05], 0), "b"),
            arm("pause", summary(11.0, 0.9, 0.7), steps([0.2], 2), "c"),
            arm("finish", summary(13.0, 0.8, 1.2), steps([0.07], 0), "d")]
    assert arms[0]["push_total_s_median"] == 0.2 and arms[0]["resubmits"] == 12
    report = {"repeats": 2, "arms": arms, **compare(arms)}
    pause, finish = report["by_mode"]["pause"], report["by_mode"]["finish"]
    assert pause["steady_samples_per_s"] == 10.5 and finish["steady_samples_per_s"] == 12.5
    assert pause["eval_accuracy_after"] == pytest.approx(0.85) and finish["resubmits"] == 0
    assert "rollout_idle_fraction" not in pause  # unknown in a run: not averaged
    assert report["faster"] == "finish"
    line = summary_line(report)
    assert line.startswith("bench_lora_push [2 run(s) per mode]: pause: 10.50 samples/s")
    assert "finish: 12.50 samples/s steady" in line and line.endswith("faster: finish")


def test_each_arm_is_the_vllm_lora_run_with_its_mode(tmp_path):
    c = load_config(None, ["overrides=[train.steps=5]"], schema=BenchLoraPushConfig)
    cfg = arm_config(c, "finish", tmp_path)
    assert (cfg.rollout.backend, cfg.rollout.lora_push, cfg.train.steps) == ("vllm", "finish", 5)
    assert cfg.model.lora.enabled and cfg.run.eval_after and cfg.run.run_dir == str(tmp_path)


@pytest.mark.parametrize("overrides,message", [
    (["modes=[abort]"], "modes must be a non-empty subset"),
    (["repeats=0"], "repeats must be >= 1"),
    (["overrides=[algo.eta=-1]"], "eta"),
])
def test_bad_bench_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check(load_config(None, overrides, schema=BenchLoraPushConfig))
