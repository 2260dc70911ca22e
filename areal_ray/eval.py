"""Held-out evaluation through the rollout service: greedy pass@1 by default, or
sampled pass@1 and pass@k (the unbiased estimator of Chen et al., 2021).

It sends every prompt to the Serve app at once (the engine batches them) and grades
the answers with the same bounded checker the training reward uses (a child process
with a deadline; code runs in the sandbox).
"""

from __future__ import annotations

import functools
import math
import time

from areal_ray.reward.pool import TimedChecker, check


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(handle, tokenizer, rows: list[dict], max_new_tokens: int,
             temperature: float = 0.0, timeout_s: float = 30.0, samples: int = 1,
             ks: tuple[int, ...] = (1,), checkers: dict | None = None) -> dict:
    """`samples` generations per problem, all sent at once; accuracy is the mean share
    of correct samples (pass@1), and pass@k for each k in `ks`. `checkers`: the
    extra reward checkers (reward.checkers)."""
    t0 = time.perf_counter()
    pending = []
    for r in rows:
        ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        pending.append([handle.generate.remote(ids, max_new_tokens, temperature)
                        for _ in range(samples)])
    counts, lengths, versions = [], [], set()
    checker = TimedChecker(timeout_s, functools.partial(check, checkers=dict(checkers))
                           if checkers else check)
    checker.warm()
    try:
        for r, resps in zip(rows, pending):
            correct = 0
            for resp in resps:
                out = resp.result(timeout_s=600)
                text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
                correct += checker(r.get("verifier", "math"), text, r["answer"])[0] > 0
                lengths.append(len(out["output_ids"]))
                versions.update(out["versions"])
            counts.append(correct)
    finally:
        checker.close()
    n = max(len(rows), 1)
    return {"accuracy": sum(counts) / (n * samples), "n": len(rows), "samples": samples,
            **{f"pass@{k}": sum(pass_at_k(samples, c, k) for c in counts) / n for k in ks},
            "mean_len": sum(lengths) / max(len(lengths), 1), "versions": sorted(versions),
            "eval_s": time.perf_counter() - t0}
