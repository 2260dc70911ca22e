"""`Config`, the run's whole configuration: one section per component, and the few
checks that span sections (each section checks its own fields in its module)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.algo import AlgoConfig
from areal_ray.config.eval import EvalConfig
from areal_ray.config.model import ModelConfig
from areal_ray.config.reward import RewardConfig
from areal_ray.config.rollout import RolloutConfig
from areal_ray.config.run import RunConfig
from areal_ray.config.section import require, section
from areal_ray.config.sft import SftConfig
from areal_ray.config.task import TaskConfig
from areal_ray.config.train import TrainConfig
from areal_ray.config.weights import WeightsConfig


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = section(ModelConfig, "the trained model")
    task: TaskConfig = section(TaskConfig, "prompts and reference answers")
    rollout: RolloutConfig = section(RolloutConfig, "the inference engines (Serve replicas)")
    reward: RewardConfig = section(RewardConfig, "the reward actor pool")
    algo: AlgoConfig = section(AlgoConfig, "the RL algorithm")
    train: TrainConfig = section(TrainConfig, "the trainer (Ray Train)")
    weights: WeightsConfig = section(WeightsConfig, "weight pushes to the replicas")
    run: RunConfig = section(RunConfig, "outputs, cluster, MLflow, resume")
    eval: EvalConfig = section(EvalConfig, "the standalone eval job")
    sft: SftConfig = section(SftConfig, "the supervised fine-tuning job (jobs.sft)")


def engine_tensor_parallel(rollout) -> int:
    """GPUs one replica's engine spans (vLLM tensor_parallel_size, sglang tp_size)."""
    kw = rollout.engine_kwargs
    return int(kw.get("tensor_parallel_size", kw.get("tp_size", 1)) or 1)


def check_across(cfg: Config) -> None:
    """What one section cannot check alone: settings that must fit each other."""
    require(0 <= cfg.algo.reward_shaping.overlong_tokens < cfg.rollout.max_new_tokens,
            "algo.reward_shaping.overlong_tokens must be in [0, rollout.max_new_tokens)")
    require(cfg.algo.microbatch.max_tokens > 0 or cfg.train.gpu_memory_gib > 0,
            "algo.microbatch.max_tokens=0 (pick by the memory model) needs train.gpu_memory_gib")
    require(cfg.weights.backend != "nccl" or cfg.train.use_gpu,
            "weights.backend=nccl needs train.use_gpu=true (NCCL sends from the trainer's GPU); "
            "CPU trainers use weights.backend=gloo")
    require(cfg.weights.backend != "nccl" or cfg.rollout.num_gpus > 0,
            "weights.backend=nccl needs rollout.num_gpus > 0 (every replica receives on its GPU)")
    tp = engine_tensor_parallel(cfg.rollout)
    require(tp == 1 or cfg.rollout.num_gpus >= tp,
            f"rollout.num_gpus={cfg.rollout.num_gpus:g} but the engine is tensor parallel over {tp} "
            f"GPUs (rollout.engine_kwargs): each replica needs rollout.num_gpus={tp}")
    check_lora(cfg)
    # The engine returns the logprobs of the distribution it sampled from, tempered; the
    # teacher scores at T=1. Their difference would be the temperature's, not the models'.
    require(not cfg.algo.distill.enabled or cfg.rollout.temperature == 1.0,
            f"algo.distill.enabled needs rollout.temperature=1 (it is {cfg.rollout.temperature:g}): "
            "the student's behaviour logprobs are tempered and the teacher's are not, so their "
            "difference would not be the per-token reverse KL")
    require("flash" not in cfg.model.attn_implementation or cfg.train.use_gpu,
            f"model.attn_implementation={cfg.model.attn_implementation} needs train.use_gpu=true "
            "(CUDA-only kernels)")


LORA_BACKENDS = ("hf", "vllm", "sglang")  # engines that apply a pushed adapter (InferenceEngine.update_adapter)
FINISH_BACKENDS = ("vllm", "sglang")  # engines that serve several adapters at once
VLLM_MAX_LORA_RANK = 512  # vLLM's largest max_lora_rank (rollout/engines/vllm_lora.py)


def lora_push_mode(rollout) -> str:
    """`rollout.lora_push` as the replicas apply it: auto is finish on the engines that
    serve several adapters at once, pause on the others."""
    if rollout.lora_push == "auto":
        return "finish" if rollout.backend in FINISH_BACKENDS else "pause"
    return str(rollout.lora_push)


def check_lora(cfg: Config) -> None:
    """With `model.lora.enabled`, pushes carry only the adapter (every weight path
    carries one, an `AdapterPayload` around its own payload): an engine that cannot
    apply it is refused here rather than left to serve the wrong weights."""
    if not cfg.model.lora.enabled:
        return
    require(cfg.rollout.backend in LORA_BACKENDS,
            f"model.lora.enabled: rollout.backend={cfg.rollout.backend} cannot apply a pushed "
            f"adapter yet; use rollout.backend={' or '.join(LORA_BACKENDS)}")
    require(cfg.rollout.lora_push != "finish" or cfg.rollout.backend in FINISH_BACKENDS,
            f"rollout.lora_push=finish needs rollout.backend={' or '.join(FINISH_BACKENDS)} "
            f"(one engine serving several adapters at once); {cfg.rollout.backend} applies one "
            "adapter to its weights: rollout.lora_push=pause")
    require(cfg.rollout.backend != "vllm" or cfg.model.lora.rank <= VLLM_MAX_LORA_RANK,
            f"model.lora.rank={cfg.model.lora.rank}: vLLM serves adapters of rank <= "
            f"{VLLM_MAX_LORA_RANK} only")
