"""model.lora's preflight (`check_lora_targets`, before Ray): a LoRA run in an environment
without peft fails there, naming the package, instead of in every Train worker after
the rollout app has started."""

import importlib.util

import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.run.job import check_lora_targets

REAL_FIND_SPEC = importlib.util.find_spec


def without_peft(name, *args, **kwargs):
    """importlib's answer with peft uninstalled (peft is an outside package)."""
    return None if name == "peft" else REAL_FIND_SPEC(name, *args, **kwargs)


def test_lora_without_peft_fails_before_ray_naming_the_package(random_model_dir, monkeypatch):
    cfg = load_config(None, ["model.lora.enabled=true"])
    check_lora_targets(cfg, random_model_dir)  # peft is installed here: passes
    monkeypatch.setattr(importlib.util, "find_spec", without_peft)
    with pytest.raises(ConfigError, match=r"model.lora.enabled needs the peft package.*peft==0.21.2"):
        check_lora_targets(cfg, random_model_dir)
    check_lora_targets(load_config(None, []), random_model_dir)  # no LoRA: peft not needed
