"""Shared fixtures: one local Ray cluster per test session, small models built on the spot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """A randomly initialised 2-layer char-level Qwen2 model (fast; nothing learned)."""
    from transformers import AutoModelForCausalLM

    from areal_ray.task.tiny_model import TinyModelSpec, qwen2_config
    from areal_ray.task.tokenizer import save_char_tokenizer

    out = tmp_path_factory.mktemp("random_model")
    tok = save_char_tokenizer(out)
    torch.manual_seed(0)
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2)
    AutoModelForCausalLM.from_config(qwen2_config(spec, tok)).save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def ray_cluster():
    """A private local cluster shared by every test that needs Ray (started once)."""
    import ray

    env = {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": env}, logging_level="WARNING")
    from ray.data import DataContext
    DataContext.get_current().enable_progress_bars = False
    yield ray
    from ray import serve
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """The committed, warm-started tiny model (built here if it is missing)."""
    from areal_ray.run import resolve_model
    os.chdir(REPO)
    return resolve_model("artifacts/tiny")
