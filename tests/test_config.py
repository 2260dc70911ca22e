from pathlib import Path

import pytest

from areal_ray.config import ConfigError, help_lines, load_config

REPO = Path(__file__).resolve().parent.parent


def test_yaml_and_overrides(tmp_path):
    cfg = load_config("conf/quickstart.yaml", ["algo.eta=4", "algo.dual_clip=3.0"])
    assert cfg.algo.eta == 4 and cfg.algo.dual_clip == 3.0
    assert cfg.train.steps > 0


@pytest.mark.parametrize("overrides,match", [
    (["algo.etaa=1"], "etaa"),
    (["algo.eta=abc"], "algo.eta"),
    (["algo.eta=-1"], "algo.eta"),
    (["nonsense"], "key=value"),
    (["rollout.min_replicas=3", "rollout.max_replicas=2"], "min_replicas"),
    (["algo.eta=[1,"], r"override 'algo.eta=\[1,': the value is not valid YAML"),
    (["algo.eta={"], "algo.eta={"),
])
def test_bad_input_is_a_clear_error(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_unknown_key_in_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  not_a_key: 1\n")
    with pytest.raises(ConfigError, match="not_a_key"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_every_key_has_help():
    lines = help_lines()
    assert any(line.strip().startswith("algo.eta =") for line in lines)
    assert all("#" in line and line.split("#", 1)[1].strip() for line in lines)


@pytest.mark.parametrize("overrides,match", [
    (["algo.adv_estimator=magic"], "adv_estimator"),
    (["algo.overlong_tokens=500", "rollout.max_new_tokens=96"], "overlong_tokens"),
    (["rollout.backend=tgi"], "rollout.backend"),
    (["rollout.batching=dynamic"], "rollout.batching"),
    (["rollout.router=round_robin"], "rollout.router"),
])
def test_algorithm_choices_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("overrides,match", [
    (["weights.backend=nccl", "rollout.num_gpus=1"], "weights.backend=nccl needs train.use_gpu=true"),
    (["weights.backend=nccl", "train.use_gpu=true"], "rollout.num_gpus"),
    (["model.attn_implementation=flash_attention_2"], "train.use_gpu=true"),
    (["train.master_dtype=fp32"], "train.master_dtype"),
])
def test_gpu_settings_must_fit_together(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_gpu_settings_that_fit_are_accepted():
    cfg = load_config(None, ["weights.backend=nccl", "train.use_gpu=true", "rollout.num_gpus=1",
                             "model.attn_implementation=flash_attention_2",
                             "model.dtype=bfloat16", "train.master_dtype=float32"])
    assert cfg.train.use_gpu and cfg.weights.backend == "nccl"
    assert not load_config(None).train.use_gpu  # CPU stays the default


@pytest.mark.parametrize("path", sorted(str(p) for p in (REPO / "conf").glob("*.yaml")
                                         if not p.name.startswith("bench_")))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.run.name and cfg.train.steps >= 1


def test_benchmark_config_loads():
    """conf/bench_*.yaml configure a benchmark: its keys, with a run config under `base`."""
    from jobs.bench_async import BenchAsyncConfig, check
    c = check(load_config(str(REPO / "conf" / "bench_async.yaml"), schema=BenchAsyncConfig))
    assert 0 in c.etas and c.base.train.steps >= 1


def test_a_yaml_syntax_error_in_a_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("algo:\n  eta: 2\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML: .*\(line 4, column 1\)"):
        load_config(str(bad))


@pytest.mark.parametrize("args", [["algo.eta=[1,"], ["--config", "{path}"]])
def test_yaml_errors_exit_2_with_one_line(tmp_path, args):
    import subprocess
    import sys
    bad = tmp_path / "broken.yaml"
    bad.write_text("algo: [\n")
    argv = [a.replace("{path}", str(bad)) for a in args]
    res = subprocess.run([sys.executable, "-m", "jobs.train", *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
