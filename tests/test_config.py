from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from areal_ray.config import (
    AdvEstimator,
    Config,
    ConfigError,
    RolloutBackend,
    help_lines,
    load_config,
    to_dict,
    validate,
)
from areal_ray.config.choices import Choice

REPO = Path(__file__).resolve().parent.parent


def test_yaml_and_overrides(tmp_path):
    cfg = load_config("conf/quickstart.yaml", ["algo.eta=4", "algo.loss.dual_clip=3.0"])
    assert cfg.algo.eta == 4 and cfg.algo.loss.dual_clip == 3.0
    assert cfg.algo.optim.lr == 1e-4 and cfg.train.steps > 0


@pytest.mark.parametrize("overrides,match", [
    (["algo.etaa=1"], "etaa"),
    (["algo.eta=abc"], "algo.eta"),
    (["nonsense"], "key=value"),
    (["algo.eta=[1,"], r"override 'algo.eta=\[1,': the value is not valid YAML"),
    (["algo.eta={"], "algo.eta={"),
    # a section where a value was: the keys that moved into sub-sections name their new home
    (["algo.dynamic_filter=true"], r"algo.dynamic_filter is a section.*algo.dynamic_filter.enabled"),
])
def test_bad_input_is_a_clear_error(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_errors_are_one_line_led_by_the_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algo.loss.eps_clip=wide"])
    assert str(e.value).startswith("bad config (defaults): algo.loss.eps_clip: ")
    assert "\n" not in str(e.value)


def test_unknown_key_in_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  not_a_key: 1\n")
    with pytest.raises(ConfigError, match="not_a_key"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


# Every check of every section and across sections: (overrides, the key its error names).
CHECKS = [
    (["task.shuffle_window=0"], "task.shuffle_window must be >= 1"),
    (["task.chain_p_stop=0"], r"task.chain_p_stop must be in \(0, 1\]"),
    (["task.chain_p_stop=1.5"], r"task.chain_p_stop must be in \(0, 1\]"),
    (["task.chain_median_steps=0.5"], "task.chain_median_steps must be >= 1"),
    (["task.chain_sigma=-1"], "task.chain_sigma must be >= 0"),
    (["task.chain_max_steps=0"], "task.chain_max_steps must be >= 1"),
    (["task.answer_field=''"], "task.answer_field must name"),
    (["task.embedded=tool_arith", "task.train_path=a.jsonl", "task.eval_path=b.jsonl"],
     "task.embedded=tool_arith is used only where task.train_path or task.eval_path is empty"),
    (["rollout.group_size=0"], "rollout.group_size must be >= 1"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens must be >= 1"),
    (["rollout.temperature=0"], "rollout.temperature must be > 0"),
    (["rollout.min_replicas=0"], r"rollout.min_replicas <= rollout.max_replicas"),
    (["rollout.min_replicas=3", "rollout.max_replicas=2"], r"rollout.min_replicas <= rollout.max_replicas"),
    (["rollout.target_ongoing_requests=-1"], "rollout.target_ongoing_requests must be >= 0"),
    (["rollout.episode_timeout_s=-1"], "rollout.episode_timeout_s must be >= 0"),
    (["reward.min_actors=0"], "reward.min_actors <= reward.max_actors"),
    (["reward.min_actors=3", "reward.max_actors=2"], "reward.min_actors <= reward.max_actors"),
    (["algo.eta=-1"], "algo.eta must be >= 0"),
    (["algo.batch_groups=0"], "algo.batch_groups must be >= 1"),
    (["algo.optim.ppo_minibatches=0"], r"algo.optim.ppo_minibatches must be in \[1, algo.batch_groups\]"),
    (["algo.optim.ppo_minibatches=9", "algo.batch_groups=8"], "algo.optim.ppo_minibatches must be in"),
    (["algo.optim.lr_warmup_steps=-1"], "algo.optim.lr_warmup_steps must be >= 0"),
    (["algo.loss.dual_clip=1.0"], "algo.loss.dual_clip must be > 1 or null"),
    (["algo.loss.kl_coef=-0.1"], "algo.loss.kl_coef must be >= 0"),
    (["algo.dynamic_filter.prompt_factor=0.5"], "algo.dynamic_filter.prompt_factor must be >= 1"),
    (["algo.microbatch.max_tokens=-1"], "algo.microbatch.max_tokens must be >= 0"),
    (["train.num_workers=0"], "train.num_workers must be >= 1"),
    (["train.steps=0"], "train.steps must be >= 1"),
    (["train.checkpoint_every=-1"], "train.checkpoint_every must be >= 0"),
    (["train.max_failures=-1"], "train.max_failures must be >= 0"),
    (["train.logits_chunk_mb=0"], "train.logits_chunk_mb must be >= 1"),
    (["train.gpu_memory_gib=-1"], "train.gpu_memory_gib must be >= 0"),
    (["train.num_gpus_per_worker=1.5"], "train.num_gpus_per_worker must be a fraction"),
    (["train.num_gpus_per_worker=0"], "train.num_gpus_per_worker must be a fraction"),
    (["rollout.num_gpus=-1"], "rollout.num_gpus must be >= 0"),
    (["rollout.num_gpus=1.5"], "rollout.num_gpus must be a fraction"),
    (["run.placement_timeout_s=0"], "run.placement_timeout_s must be > 0"),
    (["weights.bucket_mb=0"], "weights.bucket_mb must be >= 1"),
    (["weights.timeout_s=0"], "weights.timeout_s must be > 0"),
    (["run.resume=true"], "run.resume needs run.run_dir"),
    (["run.register_model=m", "run.log_model=false"], "run.register_model needs run.log_model=true"),
    (["eval.k=0"], "eval.k must be >= 1"),
    (["eval.temperature=0"], "eval.temperature must be > 0"),
    # across sections
    (["algo.reward_shaping.overlong_tokens=96", "rollout.max_new_tokens=96"],
     r"algo.reward_shaping.overlong_tokens must be in \[0, rollout.max_new_tokens\)"),
    (["algo.reward_shaping.overlong_tokens=-1"], "algo.reward_shaping.overlong_tokens must be in"),
    (["algo.microbatch.max_tokens=0"], "algo.microbatch.max_tokens=0 .* needs train.gpu_memory_gib"),
    (["weights.backend=nccl", "rollout.num_gpus=1"], "weights.backend=nccl needs train.use_gpu=true"),
    (["weights.backend=nccl", "train.use_gpu=true"], "weights.backend=nccl needs rollout.num_gpus > 0"),
    (["model.attn_implementation=flash_attention_2"], "model.attn_implementation=.* needs train.use_gpu=true"),
    (["rollout.engine_kwargs.tensor_parallel_size=2", "rollout.num_gpus=1"],
     r"tensor parallel over 2 GPUs .* needs rollout.num_gpus=2"),
    (["rollout.engine_kwargs.tp_size=4", "rollout.num_gpus=2"], r"tensor parallel over 4 GPUs"),
    (["model.lora.rank=0"], r"model.lora.rank must be >= 1 \(got 0\)"),
    (["model.lora.alpha=0"], "model.lora.alpha must be > 0"),
    (["model.lora.dropout=1"], r"model.lora.dropout must be in \[0, 1\)"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules must name at least one module"),
    # LoRA pushes only the adapter: engines that cannot apply one are refused
    (["model.lora.enabled=true", "rollout.lora_push=finish"],
     r"rollout.lora_push=finish needs rollout.backend=vllm or sglang .* hf applies one adapter"),
    (["model.lora.enabled=true", "weights.path=shm", "rollout.backend=vllm", "model.lora.rank=513"],
     r"model.lora.rank=513: vLLM serves adapters of rank <= 512"),
]


@pytest.mark.parametrize("overrides,match", CHECKS, ids=[" ".join(o) for o, _ in CHECKS])
def test_each_check_names_its_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


# Every named choice: a value off the list is refused by its type, naming the key and the list.
CHOICES = [
    ("rollout.backend", "tgi", "hf, vllm, sglang"),
    ("rollout.batching", "dynamic", "continuous, static, invariant"),
    ("rollout.router", "round_robin", "least_tokens, pow2"),
    ("rollout.lora_push", "abort", "auto, pause, finish"),
    ("algo.adv.estimator", "magic", "grpo, dr_grpo, rloo, gae"),
    ("algo.adv.norm", "group", "none, batch"),
    ("algo.loss.name", "reinforce", "decoupled_ppo, cispo"),
    ("algo.loss.correction.mode", "tis", "off, token_tis, seq_tis, token_mis, seq_mis, geo_mis, icepop"),
    ("algo.loss.importance_level", "word", "token, sequence"),
    ("algo.loss.prox_logp", "guess", "recompute, loglinear"),
    ("algo.loss.kl_estimator", "k4", "k1, k2, k3"),
    ("algo.optim.lr_schedule", "step", "constant, linear, cosine"),
    ("weights.path", "ftp", "auto, collective, shm, object_store, disk"),
    ("weights.backend", "mpi", "gloo, nccl"),
    ("task.embedded", "chess", "arith, tool_arith, chain_arith"),
    ("train.master_dtype", "fp32", "'', 'float32', 'bfloat16', 'float16'"),
]


@pytest.mark.parametrize("key,bad,allowed", CHOICES, ids=[k for k, _, _ in CHOICES])
def test_each_choice_names_its_key_and_the_allowed_values(key, bad, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={bad}"])
    msg = str(e.value)
    assert f"{key}: " in msg and repr(bad) in msg and f"[{allowed}]" in msg, msg


@pytest.mark.parametrize("backend,value,mode", [
    ("vllm", "auto", "finish"), ("sglang", "auto", "finish"), ("hf", "auto", "pause"),
    ("vllm", "pause", "pause"), ("vllm", "finish", "finish")])
def test_lora_push_auto_is_finish_where_the_engine_serves_several_adapters(backend, value, mode):
    from areal_ray.config.root import lora_push_mode
    from deployments.rollout import ServerOptions
    cfg = load_config(None, ["model.lora.enabled=true", f"rollout.backend={backend}",
                             f"rollout.lora_push={value}", "algo.eta=3"])
    assert lora_push_mode(cfg.rollout) == mode
    opts = ServerOptions.from_config(cfg)
    assert (opts.lora_push, opts.lora_slots) == (mode, 5 if mode == "finish" else 2)


@pytest.mark.parametrize("overrides,engine", [
    ([], "float32"), (["model.dtype=bfloat16"], "bfloat16"),
    (["rollout.dtype=bfloat16"], "bfloat16"), (["model.dtype=bfloat16", "rollout.dtype=float32"], "float32"),
])
def test_the_engines_dtype_is_rollout_dtype_else_the_models(overrides, engine):
    from areal_ray.cluster.plan import engine_gib
    from deployments.rollout import ServerOptions
    cfg = load_config(None, ["rollout.max_batch_size=1", *overrides])
    assert ServerOptions.from_config(cfg).dtype == engine
    shape = type("Shape", (), {"params": 1 << 30, "layers": 1, "kv_dim": 1})()
    ref = engine_gib(load_config(None, ["rollout.max_batch_size=1", f"model.dtype={engine}"]), shape, 80.0)
    assert engine_gib(cfg, shape, 80.0) == ref  # the planner counts the engine's bytes, not the trainer's
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(None, ["rollout.dtype=int8"])


def test_lora_is_off_by_default_and_accepted_on_the_paths_and_engines_that_carry_it():
    assert not load_config(None, []).model.lora.enabled
    for path in ("auto", "collective", "shm", "object_store", "disk"):
        for backend in ("hf", "vllm", "sglang"):
            cfg = load_config(None, ["model.lora.enabled=true", f"weights.path={path}",
                                     f"rollout.backend={backend}", "model.lora.rank=4",
                                     "model.lora.alpha=8"])
            assert cfg.model.lora.scaling == 2.0


def test_choices_read_as_their_strings():
    cfg = load_config(None, ["rollout.backend=vllm", "algo.adv.estimator=gae"])
    assert cfg.rollout.backend == "vllm" and f"{cfg.rollout.backend}" == "vllm"
    assert cfg.algo.adv.estimator is AdvEstimator.gae and {"gae": 1}[cfg.algo.adv.estimator] == 1
    assert to_dict(cfg)["rollout"]["backend"] == "vllm" and type(to_dict(cfg)["rollout"]["backend"]) is str
    for choice in Choice.__subclasses__():  # members are named by their values: the error lists them
        assert [m.name for m in choice] == list(choice.values()), choice


def test_a_config_changed_in_code_is_checked_too():
    cfg = load_config(None)
    cfg.rollout.backend = "tgi"
    with pytest.raises(ConfigError, match=r"rollout.backend: .*expected one of \[hf, vllm, sglang\]"):
        validate(cfg)
    cfg.rollout.backend = "vllm"  # a plain string of a member is fine
    assert validate(cfg).rollout.backend == RolloutBackend.vllm


def _leaf_keys(cls, prefix=""):
    for f in fields(cls):
        if is_dataclass(f.default_factory):
            yield from _leaf_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_every_key_has_help():
    lines = help_lines()
    keys = [line.split("=", 1)[0].strip() for line in lines]
    assert keys == list(_leaf_keys(Config)) and "algo.loss.eps_clip" in keys and "algo.eta" in keys
    assert all("#" in line and line.split("#", 1)[1].strip() for line in lines)
    assert any(line.startswith("  algo.adv.estimator = 'grpo'    # advantages:") for line in lines)  # a value


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


def test_moved_keys_in_a_shipped_config_arrive():
    cfg = load_config(str(REPO / "conf" / "code_qwen_sglang.yaml"))
    assert cfg.algo.dynamic_filter.enabled and cfg.algo.reward_shaping.overlong_tokens == 256
    assert cfg.algo.loss.eps_clip_high == 0.28 and cfg.algo.microbatch.max_tokens == 16384
    cfg = load_config(str(REPO / "conf" / "gsm8k_qwen_sglang.yaml"))
    assert (cfg.algo.adv.norm, cfg.algo.reward_shaping.bias, cfg.algo.optim.weight_decay) == ("batch", -0.5, 0.017)


def test_benchmark_config_loads():
    """conf/bench_*.yaml configure a benchmark: its keys, with a run config under `base`."""
    from benchmarks.bench_async import BenchAsyncConfig, check
    c = check(load_config(str(REPO / "conf" / "bench_async.yaml"), schema=BenchAsyncConfig))
    assert 0 in c.etas and c.base.train.steps >= 1
    from benchmarks.bench_distill import BenchDistillConfig
    from benchmarks.bench_distill import check as check_distill
    d = check_distill(load_config(str(REPO / "conf" / "bench_distill.yaml"), schema=BenchDistillConfig))
    assert d.base.algo.distill.enabled and d.base.algo.eta == 0 and len(d.seeds) == 3


def test_a_yaml_syntax_error_in_a_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("algo:\n  eta: 2\n  batch_groups: [1,\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML: .*\(line 4, column 1\)"):
        load_config(str(bad))


@pytest.mark.parametrize("args", [["algo.eta=[1,"], ["--config", "{path}"], ["rollout.backend=tgi"]])
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
