import pytest

from areal_ray.config import ConfigError, help_lines, load_config


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
    (["rollout.backend=vllm"], "rollout.backend"),
    (["rollout.batching=dynamic"], "rollout.batching"),
    (["rollout.router=round_robin"], "rollout.router"),
])
def test_algorithm_choices_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
