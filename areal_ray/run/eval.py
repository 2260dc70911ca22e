"""Held-out evaluation through the rollout service: greedy pass@1 by default, or
sampled pass@1 and pass@k (the unbiased estimator of Chen et al., 2021).

It sends every prompt to the Serve app at once (the engine batches them), or, for a
run whose rollout workflow is not the single-turn one (e.g. tool calls), runs that
workflow's episodes, so a task is evaluated the way it trains. Answers are graded by
the same bounded checker the training reward uses (a child process with a deadline;
code runs in the sandbox).
"""

from __future__ import annotations

import functools
import math
import time

from areal_ray.reward.pool import TimedChecker, check
from areal_ray.rollout.engines.base import GenerationRequest


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def single_turn_outputs(handle, tokenizer, rows: list[dict], max_new_tokens: int,
                        temperature: float, samples: int) -> list[list[dict]]:
    """Per row, `samples` outputs {text, n_tokens, versions, tool_calls}: every
    prompt sent at once (the engine batches them)."""
    pending = []
    for r in rows:
        ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        pending.append([handle.generate.remote(GenerationRequest(ids, max_new_tokens, temperature))
                        for _ in range(samples)])
    outputs = []
    for resps in pending:
        outs = [resp.result(timeout_s=600) for resp in resps]
        outputs.append([{"text": tokenizer.decode(o["output_ids"], skip_special_tokens=True),
                         "n_tokens": len(o["output_ids"]), "versions": o["versions"],
                         "tool_calls": 0} for o in outs])
    return outputs


def workflow_outputs(handle, rows: list[dict], workflow: str, workflow_kwargs: dict | None,
                     max_new_tokens: int, temperature: float, samples: int,
                     concurrency: int = 128) -> list[list[dict]]:
    """Per row, `samples` outputs of the run's rollout workflow (its episodes, with
    `samples` as the group size): a multi-turn task is evaluated the way it trains.
    A row the workflow rejects counts as `samples` wrong answers."""
    import asyncio

    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.workflows.base import EpisodeConfig, build_workflow

    flow = build_workflow(workflow, EpisodeConfig(samples, max_new_tokens, temperature),
                          workflow_kwargs)
    client = EngineClient(handle)

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


def evaluate(handle, tokenizer, rows: list[dict], max_new_tokens: int,
             temperature: float = 0.0, timeout_s: float = 30.0, samples: int = 1,
             ks: tuple[int, ...] = (1,), checkers: dict | None = None,
             workflow: str = "", workflow_kwargs: dict | None = None) -> dict:
    """`samples` generations per problem; accuracy is the mean share of correct
    samples (pass@1), and pass@k for each k in `ks`. `checkers`: the extra reward
    checkers (reward.checkers). `workflow` (rollout.workflow), when not the
    single-turn one, generates through the workflow's episodes, e.g. with tool calls."""
    from areal_ray.rollout.workflows.base import SINGLE_TURN
    t0 = time.perf_counter()
    if workflow and workflow != SINGLE_TURN:
        outputs = workflow_outputs(handle, rows, workflow, workflow_kwargs, max_new_tokens,
                                   temperature, samples)
    else:
        outputs = single_turn_outputs(handle, tokenizer, rows, max_new_tokens, temperature,
                                      samples)
    counts, lengths, versions, calls = [], [], set(), []
    checker = TimedChecker(timeout_s, functools.partial(check, checkers=dict(checkers))
                           if checkers else check)
    checker.warm()
    try:
        for r, outs in zip(rows, outputs):
            correct = 0
            for o in outs:
                correct += checker(r.get("verifier", "math"), o["text"], r["answer"])[0] > 0
                lengths.append(o["n_tokens"])
                versions.update(v for v in o["versions"] if v >= 0)
                calls.append(o["tool_calls"])
            counts.append(correct)
    finally:
        checker.close()
    n = max(len(rows), 1)
    out = {"accuracy": sum(counts) / (n * samples), "n": len(rows), "samples": samples,
           **{f"pass@{k}": sum(pass_at_k(samples, c, k) for c in counts) / n for k in ks},
           "mean_len": sum(lengths) / max(len(lengths), 1), "versions": sorted(versions),
           "eval_s": time.perf_counter() - t0}
    if any(calls):
        out["tool_use_rate"] = sum(c > 0 for c in calls) / len(calls)
        out["tool_calls_mean"] = sum(calls) / len(calls)
    return out
