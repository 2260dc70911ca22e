"""The served rewards' Serve apps: `Judge` (a generative judge on an inference engine,
areal_ray/rollout/engines/) and `RewardModel` (a sequence-classification head), each
its own app, autoscaled between `min_replicas` and `max_replicas`, every call one item
(question, sample text, reference) batched by `serve.batch` (`max_batch_size`,
`batch_wait_timeout_s`) and answered with (reward, reason). The deadline is the
caller's (areal_ray/judge/client.py): a replica only answers.

The apps are named from the job's tag (cluster/ownership.py `Owned.served_app_name`),
so what removes a dead job's rollout app removes these too.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch
from ray import serve

from areal_ray.config.judge import JudgeConfig, RewardModelConfig
from areal_ray.judge.client import DEPLOYMENTS
from areal_ray.judge.parse import parse
from areal_ray.judge.prompt import Item, render
from areal_ray.rollout.engines.base import EngineOptions, GenerationRequest
from areal_ray.rollout.engines.registry import build_engine
from areal_ray.task.tokenizer import load_tokenizer

logger = logging.getLogger("ray.serve")


@dataclass
class JudgeOptions:
    """What a judge replica needs from `reward.judge` (small and picklable)."""
    template: str
    max_new_tokens: int
    parser: str
    score_max: float
    max_batch_size: int
    batch_wait_timeout_s: float
    dtype: str
    torch_threads: int

    @classmethod
    def from_config(cls, c: JudgeConfig) -> JudgeOptions:
        return cls(c.template, c.max_new_tokens, str(c.parser), c.score_max, c.max_batch_size,
                   c.batch_wait_timeout_s, c.dtype, c.torch_threads)


@dataclass
class RewardModelOptions:
    """What a reward-model replica needs from `reward.reward_model`."""
    template: str
    squash: str
    max_len: int
    max_batch_size: int
    batch_wait_timeout_s: float
    dtype: str
    torch_threads: int

    @classmethod
    def from_config(cls, c: RewardModelConfig) -> RewardModelOptions:
        return cls(c.template, str(c.squash), c.max_len, c.max_batch_size,
                   c.batch_wait_timeout_s, c.dtype, c.torch_threads)


@serve.deployment(name=DEPLOYMENTS["judge"], health_check_period_s=5, health_check_timeout_s=60)
class JudgeServer:
    """Renders each item's prompt, generates greedily on the hf engine (which batches
    the generations of a `serve.batch` batch and of concurrent batches), parses the text."""

    async def __init__(self, model_path: str, opts: JudgeOptions):
        torch.set_num_threads(opts.torch_threads)
        self.opts = opts
        self.engine = build_engine("hf", model_path, EngineOptions(
            max_batch_size=opts.max_batch_size, dtype=opts.dtype, threads=opts.torch_threads))
        await self.engine.warmup()
        self.tokenizer = load_tokenizer(model_path)
        self.grade.set_max_batch_size(opts.max_batch_size)
        self.grade.set_batch_wait_timeout_s(opts.batch_wait_timeout_s)
        self.batches: list[int] = []  # recent batch sizes (tests, stats)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def grade(self, items: list[Item]) -> list[tuple[float, str]]:
        self.batches = (self.batches + [len(items)])[-64:]
        reqs = [GenerationRequest(self.tokenizer(render(self.opts.template, it),
                                                 add_special_tokens=False)["input_ids"],
                                  self.opts.max_new_tokens, temperature=0.0) for it in items]
        outs = await asyncio.gather(*(self.engine.generate(r) for r in reqs),
                                    return_exceptions=True)
        answers = []
        for out in outs:  # a request the engine refused fails that item only
            if isinstance(out, BaseException):
                answers.append((0.0, f"judge failed: {type(out).__name__}: {out}"[:300]))
            else:
                text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
                answers.append(parse(text, self.opts.parser, self.opts.score_max))
        return answers

    def stats(self) -> dict:
        return {"batches": list(self.batches), **self.engine.load()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        self.engine.shutdown()


@serve.deployment(name=DEPLOYMENTS["reward_model"], health_check_period_s=5,
                  health_check_timeout_s=60)
class RewardModelServer:
    """One forward per `serve.batch` batch: the scored texts right-padded, the model's
    one logit per text, squashed."""

    def __init__(self, model_path: str, opts: RewardModelOptions):
        from transformers import AutoModelForSequenceClassification
        torch.set_num_threads(opts.torch_threads)
        self.opts = opts
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=getattr(torch, opts.dtype)).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward.reward_model.model {model_path}: {self.model.config.num_labels} "
                             "labels; a reward model gives one scalar (num_labels=1)")
        self.tokenizer = load_tokenizer(model_path)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        limit = getattr(self.model.config, "max_position_embeddings", opts.max_len)
        self.max_len = min(opts.max_len, limit)
        self.grade.set_max_batch_size(opts.max_batch_size)
        self.grade.set_batch_wait_timeout_s(opts.batch_wait_timeout_s)
        self.batches: list[int] = []

    def _forward(self, texts: list[str]) -> list[float]:
        enc = self.tokenizer(texts, add_special_tokens=False, padding=True, truncation=True,
                             max_length=self.max_len, return_tensors="pt")
        with torch.no_grad():
            logits = self.model(**enc).logits[:, 0].float()
        return (torch.sigmoid(logits) if self.opts.squash == "sigmoid" else logits).tolist()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def grade(self, items: list[Item]) -> list[tuple[float, str]]:
        self.batches = (self.batches + [len(items)])[-64:]
        # in a thread: the replica's loop goes on taking calls (the next batch fills)
        scores = await asyncio.to_thread(self._forward, [render(self.opts.template, it) for it in items])
        return [(s, f"reward_model scored {s:.3g}") for s in scores]

    def stats(self) -> dict:
        return {"batches": list(self.batches)}


def _scaling(c) -> dict:
    if c.min_replicas == c.max_replicas:
        return {"num_replicas": c.min_replicas}
    return {"autoscaling_config": {
        "min_replicas": c.min_replicas, "max_replicas": c.max_replicas,
        "target_ongoing_requests": c.target_ongoing_requests,
        "upscale_delay_s": c.upscale_delay_s, "downscale_delay_s": c.downscale_delay_s}}


def build_app(kind: str, section, model_path: str):
    """The Serve app of served reward `kind` ("judge" or "reward_model") from its
    config section: replica count or autoscaling range, resources, the batcher."""
    server, opts = ((JudgeServer, JudgeOptions) if kind == "judge"
                    else (RewardModelServer, RewardModelOptions))
    return server.options(
        max_ongoing_requests=section.max_ongoing_requests,
        ray_actor_options={"num_cpus": section.num_cpus, "num_gpus": section.num_gpus},
        logging_config={"enable_access_log": False},
        **_scaling(section),
    ).bind(model_path, opts.from_config(section))


def start_served_rewards(reward, models: dict[str, str], owned, timeout_s: float) -> list[str]:
    """Deploy the run's served rewards (`models`: kind -> model dir, judge.models
    `resolve_all`) as apps named from the job's tag, all at once, then wait until
    each runs (`run.placement_timeout_s`). The names of the apps, for their deletion."""
    from areal_ray.cluster.placement import deploy_app, wait_for_app
    sections = {"judge": reward.judge, "reward_model": reward.reward_model}
    apps = []
    for kind, path in models.items():
        name = owned.served_app_name(kind)
        deploy_app(build_app(kind, sections[kind], path), name, timeout_s, wait=False)
        apps.append(name)
    for name in apps:
        wait_for_app(name, timeout_s)
    return apps
