"""The teacher Serve app of on-policy distillation (`algo.distill`, areal_ray/distill/).

`TeacherServer` replicas wrap an inference engine on the teacher's weights (never
updated) and answer, for each (prompt ids, output ids) of a group, the teacher's
logprob of every output token: the engine's `score`, the teacher-forced path the load
probe uses (weights/probe.py), over prompt + output, of which the output's part is
kept. Autoscaled between `algo.distill.min_replicas` and `max_replicas` on the calls
in flight; the caller's deadline (distill/stage.py) bounds every call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from ray import serve

from areal_ray.distill.stage import TEACHER_DEPLOYMENT
from areal_ray.rollout.engine_client import DRAIN_POLL_S
from areal_ray.rollout.engines.base import EngineOptions
from areal_ray.rollout.engines.registry import build_engine


@dataclass
class TeacherOptions:
    backend: str
    dtype: str
    torch_threads: int
    engine_kwargs: dict

    @classmethod
    def from_config(cls, cfg) -> TeacherOptions:
        d = cfg.algo.distill
        # vLLM and sglang take the rollout's engine settings (memory share, tp); hf none.
        kwargs = dict(cfg.rollout.engine_kwargs) if d.backend == cfg.rollout.backend else {}
        return cls(backend=str(d.backend), dtype=cfg.model.dtype, torch_threads=d.torch_threads,
                   engine_kwargs=kwargs)


def completion_logprobs(scored: list[float], n_prompt: int, n_output: int) -> list[float]:
    """The output tokens' part of `score(prompt + output)`, whose entry i is
    log p(ids[i + 1] | ids[:i + 1])."""
    out = scored[n_prompt - 1:]
    if n_prompt < 1 or len(out) != n_output:
        raise ValueError(f"scored {len(scored)} positions for {n_prompt} prompt and {n_output} "
                         "output tokens")
    return out


@serve.deployment(name=TEACHER_DEPLOYMENT, health_check_period_s=5, health_check_timeout_s=60,
                  graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
class TeacherServer:
    async def __init__(self, model_path: str, opts: TeacherOptions):
        torch.set_num_threads(opts.torch_threads)
        self.engine = build_engine(opts.backend, model_path, EngineOptions(
            dtype=opts.dtype, threads=opts.torch_threads, engine_kwargs=dict(opts.engine_kwargs)))
        await self.engine.warmup()

    async def score_group(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The teacher's logprob of each output token, per (prompt ids, output ids)."""
        scored = await asyncio.gather(*(self.engine.score(list(p) + list(o)) for p, o in pairs))
        return [completion_logprobs(s, len(p), len(o)) for s, (p, o) in zip(scored, pairs)]

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        self.engine.shutdown()


def build_teacher_app(cfg, teacher_path: str):
    """The teacher app for run config `cfg`: replica count or autoscaling range and
    per-replica resources (algo.distill)."""
    d = cfg.algo.distill
    if d.min_replicas == d.max_replicas:
        scaling = {"num_replicas": d.min_replicas}
    else:
        scaling = {"autoscaling_config": {
            "min_replicas": d.min_replicas, "max_replicas": d.max_replicas,
            "target_ongoing_requests": max(1, d.max_ongoing_requests // 2)}}
    return TeacherServer.options(
        max_ongoing_requests=d.max_ongoing_requests,
        ray_actor_options={"num_cpus": d.num_cpus, "num_gpus": d.num_gpus},
        logging_config={"enable_access_log": False}, **scaling,
    ).bind(teacher_path, TeacherOptions.from_config(cfg))
