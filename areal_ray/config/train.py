"""`train.*`: the Ray Train trainer (workers, steps, checkpoints, GPU and memory)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.choices import MasterDtype
from areal_ray.config.section import opt, require


@dataclass(kw_only=True)
class TrainConfig:
    num_workers: int = opt(1, "Ray Train workers (FSDP2 data parallel)")
    num_cpus_per_worker: float = opt(1.0, "CPUs reserved per trainer worker")
    steps: int = opt(30, "training steps (each one weight version)")
    seed: int = opt(0, "torch seed of the trainer")
    torch_threads: int = opt(1, "torch intra-op threads per trainer worker")
    checkpoint_every: int = opt(0, "save a resume checkpoint every N steps (HF model + optimizer + data position); 0: never")
    checkpoint_hf_model: bool = opt(True, "also write the policy in HF format into each checkpoint (model/); resuming reads the sharded state/ either way")
    max_failures: int = opt(0, "Ray Train restarts of the trainer after a worker failure (from the last checkpoint)")
    use_gpu: bool = opt(False, "trainer workers on GPUs (Ray Train use_gpu; NCCL process group)")
    resources: dict = opt({}, "custom Ray resources each trainer worker asks for, e.g. {training: 1}: workers run only on nodes started with them (ray start --resources; areal_ray/cluster/roles.py)")
    node_labels: dict = opt({}, "Ray node label selector for the trainer workers, e.g. {pool: train}: they run only on matching nodes (ray start --labels)")
    num_gpus_per_worker: float = opt(1.0, "GPUs reserved per trainer worker with use_gpu: 1, or a fraction (e.g. 0.5) when a rollout replica shares the GPU (conf/gsm8k_qwen_1gpu.yaml; the memory plan, not Ray, decides whether both fit)")
    activation_checkpointing: bool = opt(False, "recompute each decoder layer's activations in the backward instead of keeping them (about a third more compute, a fraction of the activation memory; see docs/gpu.md)")
    gpu_memory_gib: float = opt(0.0, "memory of each trainer GPU: when set, the job checks algo.microbatch.max_tokens against the memory model before it starts (and picks it when 0)")
    logits_chunk_mb: int = opt(256, "fp32 logits computed at a time for the trainer's logprobs (chunks are recomputed in the backward): bounds that memory for large vocabularies")
    master_dtype: MasterDtype = opt("", "dtype of the trainer's parameters and optimizer state; empty: model.dtype. float32 under model.dtype=bfloat16 keeps fp32 master weights and runs forward/backward in bf16 (FSDP2 mixed precision)")

    def check(self) -> None:
        from areal_ray.cluster.roles import NodeRequirement
        why = NodeRequirement.of(self).problem("train")
        require(why is None, why or "")
        require(self.num_workers >= 1, "train.num_workers must be >= 1")
        require(self.steps >= 1, "train.steps must be >= 1")
        require(self.checkpoint_every >= 0, "train.checkpoint_every must be >= 0")
        require(self.max_failures >= 0, "train.max_failures must be >= 0")
        require(self.logits_chunk_mb >= 1, "train.logits_chunk_mb must be >= 1")
        require(self.gpu_memory_gib >= 0, "train.gpu_memory_gib must be >= 0")
        g = self.num_gpus_per_worker
        require(g > 0 and (g <= 1 or g == int(g)),
                f"train.num_gpus_per_worker must be a fraction in (0, 1] or a whole number, got {g}")
