"""The trainer memory model: parameter counts against transformers' own models, bytes per
token exactly against saved-tensor hooks on the real Qwen2.5-1.5B architecture (random
weights, CPU, sdpa), and the shipped GPU configs fitting their GPUs by the model."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from areal_ray.algo.logprobs import token_logprobs
from areal_ray.config import load_config
from areal_ray.train.fsdp import enable_activation_checkpointing
from areal_ray.train.memory import (
    GIB,
    DecoderShape,
    activation_bytes_per_token,
    max_tokens,
    plan,
    random_decoder,
    saved_activation_bytes,
    trainer_memory,
)

QWEN_1_5B = "conf/models/qwen2.5-1.5b.json"
GPU_CONFIGS = ["conf/gsm8k_qwen_sglang.yaml", "conf/gsm8k_qwen_vllm.yaml", "conf/code_qwen_sglang.yaml"]


@pytest.fixture(scope="module")
def qwen_config():
    return AutoConfig.from_pretrained(QWEN_1_5B)


def test_parameter_count_matches_transformers(qwen_config, random_model_dir):
    for cfg in (qwen_config, AutoConfig.from_pretrained(random_model_dir)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        assert DecoderShape.from_hf(cfg).params == sum(p.numel() for p in model.parameters())
    assert DecoderShape.from_hf(qwen_config).params == 1_543_714_304  # "1.54B"


def test_bytes_per_token_match_saved_tensors_on_qwen2_5_1_5b(qwen_config):
    torch.manual_seed(0)
    model = random_decoder(qwen_config, torch.bfloat16)
    model.train()
    shape = DecoderShape.from_hf(qwen_config)
    ids = torch.randint(0, 1000, (1, 48))
    measured = {}
    for ac in (False, True):
        if ac:
            enable_activation_checkpointing(model)
        # chunks of 4 rows: the logits are recomputed, not kept (modelled apart)
        _, nbytes = saved_activation_bytes(
            lambda: token_logprobs(model, ids, torch.ones_like(ids), 1.0, 4 * 4 * shape.vocab), model)
        measured[ac] = nbytes / ids.shape[1]
    assert measured[False] == activation_bytes_per_token(shape, 2, checkpointing=False)  # 2.78 MiB
    assert measured[True] == activation_bytes_per_token(shape, 2, checkpointing=True)  # 96 KiB


def test_max_tokens_is_the_largest_budget_that_fits(qwen_config):
    shape = DecoderShape.from_hf(qwen_config)
    kw = dict(s=shape, world=2, checkpointing=True)
    budget = 30 * GIB
    n = max_tokens(budget, **kw)
    assert trainer_memory(tokens=n, **kw).total <= budget < trainer_memory(tokens=n + 1, **kw).total
    assert max_tokens(budget, **dict(kw, checkpointing=False)) < n / 5


@pytest.mark.parametrize("path", GPU_CONFIGS)
def test_shipped_gpu_configs_fit_their_gpus_with_margin(path, qwen_config):
    cfg = load_config(path, [])
    assert cfg.train.gpu_memory_gib > 0  # the GPU the config is written for
    p = plan(cfg, DecoderShape.from_hf(qwen_config))
    assert p["fits"] and p["margin"] >= 0.1, p
    assert cfg.algo.microbatch.max_tokens <= p["largest_max_tokens_per_mb"]


def test_the_first_versions_configs_did_not_fit(qwen_config):
    # GSM8K as shipped before: 10,240-token micro-batches, no activation checkpointing.
    cfg = load_config("conf/gsm8k_qwen_sglang.yaml", ["train.activation_checkpointing=false"])
    p = plan(cfg, DecoderShape.from_hf(qwen_config))
    assert not p["fits"] and p["gib"]["activations"] > 25


def test_the_job_refuses_a_budget_that_does_not_fit_and_picks_one_when_asked():
    from areal_ray.config import ConfigError
    from areal_ray.run.job import check_memory
    base = ["train.activation_checkpointing=false", "train.gpu_memory_gib=40"]
    with pytest.raises(ConfigError, match="does not fit train.gpu_memory_gib=40.*largest that fits is 6561"):
        check_memory(load_config("conf/gsm8k_qwen_sglang.yaml", base), QWEN_1_5B)
    cfg = load_config("conf/gsm8k_qwen_sglang.yaml", base + ["algo.microbatch.max_tokens=0"])
    check_memory(cfg, QWEN_1_5B)
    assert cfg.algo.microbatch.max_tokens == 6561
    with pytest.raises(ConfigError, match="needs train.gpu_memory_gib"):
        load_config("conf/quickstart.yaml", ["algo.microbatch.max_tokens=0"])
