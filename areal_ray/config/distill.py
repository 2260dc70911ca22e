"""`algo.distill`: on-policy distillation from a served teacher (areal_ray/distill/).

A teacher model, its own Serve app, scores the tokens the student sampled; the
per-token advantage is coef * (teacher logprob - student behaviour logprob), plus
`reward_weight` times the task reward's advantage. A teacher that does not answer
within `deadline_s` costs its group (`late`), never the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.choices import Choice, RolloutBackend
from areal_ray.config.section import opt, require


class TeacherLate(Choice):
    reward = "reward"
    drop = "drop"


# Engines whose `score` the teacher serves (rollout/engines: hf, vllm; sglang on GPUs).
TEACHER_BACKENDS = ("hf", "vllm", "sglang")


@dataclass(kw_only=True)
class DistillConfig:
    enabled: bool = opt(False, "on-policy distillation: a served teacher scores the student's sampled tokens; the advantage of each is coef * (teacher logprob - behaviour logprob) (+ reward_weight * the task advantage)")
    teacher_path: str = opt("", "the teacher's HF model dir (same tokenizer as model.path); artifacts/tiny-teacher is built on first use (make tiny-teacher)")
    backend: RolloutBackend = opt(RolloutBackend.hf, "the teacher's engine: hf | vllm | sglang (its prompt-logprob scoring path, the one the load probe uses)")
    min_replicas: int = opt(1, "teacher replicas at least (Serve autoscaling between min and max)")
    max_replicas: int = opt(1, "teacher replicas at most")
    num_cpus: float = opt(1.0, "CPUs per teacher replica")
    num_gpus: float = opt(0.0, "GPUs per teacher replica (fractions share a GPU)")
    torch_threads: int = opt(1, "torch threads per teacher replica")
    max_ongoing_requests: int = opt(16, "scoring calls (one group each) a teacher replica takes at once")
    deadline_s: float = opt(30.0, "per-call deadline of a group's scoring; past it (or on a failed call) the group is `late`")
    late: TeacherLate = opt(TeacherLate.reward, "a late or failed teacher call: reward (the group trains on the task advantage alone) | drop (the group is dropped and replaced, as the dynamic filter drops one)")
    coef: float = opt(1.0, "weight of the per-token teacher - student logprob advantage")
    reward_weight: float = opt(0.0, "weight of the task reward's advantage mixed into each token's; 0: pure distillation")

    def check(self) -> None:
        if not self.enabled:
            return
        require(bool(self.teacher_path), "algo.distill.enabled needs algo.distill.teacher_path "
                "(an HF model dir with model.path's tokenizer)")
        require(self.backend in TEACHER_BACKENDS,
                f"algo.distill.backend={self.backend} cannot score; one of {TEACHER_BACKENDS}")
        require(1 <= self.min_replicas <= self.max_replicas,
                "algo.distill.min_replicas must be >= 1 and <= algo.distill.max_replicas")
        require(self.num_cpus >= 0 and self.num_gpus >= 0,
                "algo.distill.num_cpus and num_gpus must be >= 0")
        require(self.torch_threads >= 1 and self.max_ongoing_requests >= 1,
                "algo.distill.torch_threads and max_ongoing_requests must be >= 1")
        require(self.deadline_s > 0, "algo.distill.deadline_s must be > 0 (a teacher call "
                "without a deadline could hold the run)")
        require(self.coef > 0, "algo.distill.coef must be > 0 (0 leaves no distillation: "
                "set algo.distill.enabled=false)")
        require(self.reward_weight >= 0, "algo.distill.reward_weight must be >= 0")
