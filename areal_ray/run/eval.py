"""Held-out evaluation through the rollout service: greedy pass@1 by default, or
sampled pass@1 and pass@k (the unbiased estimator of Chen et al., 2021).

It sends every prompt to the Serve app at once (the engine batches them), or, for a
run whose rollout workflow is not the single-turn one (e.g. tool calls), runs that
workflow's episodes, so a task is evaluated the way it trains. Answers are graded as
the training reward grades them: the same `Grader`, built from the same `reward.*`
settings (checkers, deadlines, code sandbox limits; areal_ray/reward/pool.py).
"""

from __future__ import annotations

import dataclasses
import math
import time

from areal_ray.reward.pool import Grader
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.workflows.base import SINGLE_TURN, EpisodeConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_episode(cfg, temperature: float, samples: int) -> EpisodeConfig:
    """The run's `EpisodeConfig` (`rollout.*`) with evaluation's own temperature and
    samples per problem; unseeded, as the single-turn path's requests are."""
    return dataclasses.replace(EpisodeConfig.from_config(cfg), group_size=samples,
                               temperature=temperature, seed=None)


def single_turn_outputs(handle, tokenizer, rows: list[dict],
                        episode: EpisodeConfig) -> list[list[dict]]:
    """Per row, `episode.group_size` outputs {text, n_tokens, versions, tool_calls}:
    every prompt sent at once (the engine batches them)."""
    pending = []
    for r in rows:
        ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        pending.append([handle.generate.remote(GenerationRequest(
            ids, episode.max_new_tokens, episode.temperature)) for _ in range(episode.group_size)])
    outputs = []
    for resps in pending:
        outs = [resp.result(timeout_s=600) for resp in resps]
        outputs.append([{"text": tokenizer.decode(o["output_ids"], skip_special_tokens=True),
                         "n_tokens": len(o["output_ids"]), "versions": o["versions"],
                         "tool_calls": 0} for o in outs])
    return outputs


def workflow_outputs(handle, rows: list[dict], workflow: str, workflow_kwargs: dict | None,
                     episode: EpisodeConfig, concurrency: int = 128) -> list[list[dict]]:
    """Per row, `episode.group_size` outputs of the run's rollout workflow (its
    episodes): a multi-turn task is evaluated the way it trains. A row the workflow
    rejects counts as that many wrong answers."""
    import asyncio

    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.workflows.base import build_workflow

    flow = build_workflow(workflow, episode, workflow_kwargs)
    client = EngineClient(handle)
    samples = episode.group_size

    async def run_all():
        gate = asyncio.Semaphore(concurrency)

        async def one(row):
            async with gate:
                group = await flow.arun_episode(client, row)
            if group is None:
                return [{"text": "", "n_tokens": 0, "versions": [], "tool_calls": 0}] * samples
            return [{"text": s.text, "n_tokens": len(s.output_ids), "versions": s.versions,
                     "tool_calls": s.tool_calls} for s in group.samples]
        return await asyncio.gather(*[one(r) for r in rows])
    return asyncio.run(run_all())


def count_correct(grader: Grader, rows: list[dict], outputs: list[list[dict]]) -> list[int]:
    """Per row, how many of its outputs `grader` finds correct (reward > 0)."""
    return [sum(grader(r.get("verifier", "math"), o["text"], r["answer"])[0] > 0 for o in outs)
            for r, outs in zip(rows, outputs)]


def evaluate(handle, tokenizer, rows: list[dict], cfg, temperature: float = 0.0,
             samples: int = 1, ks: tuple[int, ...] = (1,)) -> dict:
    """`samples` generations per problem, as run config `cfg` generates (`rollout.*`:
    the budget, the workflow) and grades (`reward.*`: `Grader.from_config`); accuracy
    is the mean share of correct samples (pass@1), and pass@k for each k in `ks`."""
    t0 = time.perf_counter()
    episode = eval_episode(cfg, temperature, samples)
    if cfg.rollout.workflow and cfg.rollout.workflow != SINGLE_TURN:
        outputs = workflow_outputs(handle, rows, cfg.rollout.workflow,
                                   dict(cfg.rollout.workflow_kwargs), episode)
    else:
        outputs = single_turn_outputs(handle, tokenizer, rows, episode)
    grader = Grader.from_config(cfg.reward)
    grader.warm()
    try:
        counts = count_correct(grader, rows, outputs)
    finally:
        grader.close()
    lengths = [o["n_tokens"] for outs in outputs for o in outs]
    calls = [o["tool_calls"] for outs in outputs for o in outs]
    versions = {v for outs in outputs for o in outs for v in o["versions"] if v >= 0}
    n = max(len(rows), 1)
    out = {"accuracy": sum(counts) / (n * samples), "n": len(rows), "samples": samples,
           **{f"pass@{k}": sum(pass_at_k(samples, c, k) for c in counts) / n for k in ks},
           "mean_len": sum(lengths) / max(len(lengths), 1), "versions": sorted(versions),
           "eval_s": time.perf_counter() - t0}
    if any(calls):
        out["tool_use_rate"] = sum(c > 0 for c in calls) / len(calls)
        out["tool_calls_mean"] = sum(calls) / len(calls)
    return out
