"""The trainer memory model: parameter counts against transformers' own models, bytes per
token exactly against saved-tensor hooks on the real Qwen2.5-1.5B architecture (two of its
layers, random weights, CPU, sdpa), and the shipped GPU configs fitting their GPUs by the model."""

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
    """Two of its 28 decoder layers (each layer's bytes are the same; the model counts
    them per layer): every width, the vocabulary and the logits are the real model's,
    at a tenth of the time and memory of building all 28."""
    import copy
    two = copy.deepcopy(qwen_config)
    two.num_hidden_layers = 2
    torch.manual_seed(0)
    model = random_decoder(two, torch.bfloat16)
    model.train()
    shape = DecoderShape.from_hf(two)
    assert shape.layers == 2 and DecoderShape.from_hf(qwen_config).layers == 28
    ids = torch.randint(0, 1000, (1, 48))
    measured = {}
    for ac in (False, True):
        if ac:
            enable_activation_checkpointing(model)
        # chunks of 4 rows: the logits are recomputed, not kept (modelled apart)
        _, nbytes = saved_activation_bytes(
            lambda: token_logprobs(model, ids, torch.ones_like(ids), 1.0, 4 * 4 * shape.vocab), model)
        measured[ac] = nbytes / ids.shape[1]
    assert measured[False] == activation_bytes_per_token(shape, 2, checkpointing=False)
    assert measured[True] == activation_bytes_per_token(shape, 2, checkpointing=True)


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


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("targets", [ALL_LINEAR, ("q_proj", "v_proj")])
def test_lora_parameters_match_peft(qwen_config, targets):
    from areal_ray.config import LoraConfig
    from areal_ray.train.lora import apply_lora, trainable_parameters
    cfg = AutoConfig.from_pretrained(QWEN_1_5B, num_hidden_layers=2)
    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(enabled=True, rank=8, target_modules=list(targets)))
    shape = DecoderShape.from_hf(cfg)
    assert 2 * shape.lora_params(8, targets) == sum(p.numel() for p in trainable_parameters(model))
    with pytest.raises(ValueError, match=r"no decoder-layer module \['lm_head'\]"):
        shape.lora_params(8, ["q_proj", "lm_head"])


def test_with_lora_only_the_adapter_has_gradients_and_optimizer_state(qwen_config):
    shape = DecoderShape.from_hf(qwen_config)
    kw = dict(s=shape, tokens=4096, world=2, compute_bytes=2, master_bytes=4)
    full = trainer_memory(**kw)
    lora = trainer_memory(**kw, lora_rank=16, lora_targets=ALL_LINEAR)
    adapter = shape.layers * shape.lora_params(16, ALL_LINEAR)  # 18.5M of 1.54B
    assert adapter == 18_464_768
    assert lora.weights == (shape.params + adapter) // 2 * 4  # the frozen base is still held
    assert lora.grads == lora.optimizer_step == adapter // 2 * 4
    assert lora.optimizer == 2 * adapter // 2 * 4  # AdamW's two moments, adapter only
    assert full.optimizer == 2 * shape.params // 2 * 4
    assert full.optimizer / lora.optimizer > 80
    # per token: every adapted module's lora_A output on top of full fine-tuning's terms
    assert lora.activations - full.activations == 4096 * shape.layers * 2 * 16 * len(ALL_LINEAR)
    assert lora.total < full.total and lora.resident < full.resident - 8 * GIB


def test_lora_activations_are_an_upper_bound_of_what_autograd_saves(qwen_config):
    from areal_ray.config import LoraConfig
    from areal_ray.train.lora import apply_lora
    # Qwen2.5-1.5B's decoder layers; two of them, and a small vocabulary (the logits
    # and embeddings are modelled apart)
    cfg = AutoConfig.from_pretrained(QWEN_1_5B, num_hidden_layers=2, vocab_size=2048)
    shape = DecoderShape.from_hf(cfg)
    torch.manual_seed(0)
    model = apply_lora(random_decoder(cfg, torch.bfloat16),
                       LoraConfig(enabled=True, rank=8, target_modules=list(ALL_LINEAR))).to(torch.bfloat16)
    model.train()
    ids = torch.randint(0, 1000, (1, 48))
    _, nbytes = saved_activation_bytes(
        lambda: token_logprobs(model, ids, torch.ones_like(ids), 1.0, 4 * 4 * shape.vocab), model)
    modelled = activation_bytes_per_token(shape, 2, checkpointing=False, lora_outputs=8 * 7)
    assert 0.85 * modelled < nbytes / ids.shape[1] <= modelled  # measured: 10% below


def test_the_plan_of_a_lora_run_counts_the_adapter(qwen_config):
    shape = DecoderShape.from_hf(qwen_config)
    base = ["train.gpu_memory_gib=24", "algo.microbatch.max_tokens=4096"]
    full = plan(load_config("conf/gsm8k_qwen_vllm.yaml", base), shape)
    lora = plan(load_config("conf/gsm8k_qwen_vllm.yaml", base + [
        "model.lora.enabled=true", "model.lora.rank=16"]), shape)
    assert lora["gib"]["optimizer"] < full["gib"]["optimizer"] / 50
    assert lora["largest_max_tokens_per_mb"] > full["largest_max_tokens_per_mb"]
