"""Held-out evaluation through the rollout service: greedy pass@1 by default.

It sends every prompt to the Serve app at once (the engine batches them) and grades
the answers with the same bounded checker the training reward uses (a child process
with a deadline; code runs in the sandbox).
"""

from __future__ import annotations

import time

from areal_ray.reward.pool import TimedChecker


def evaluate(handle, tokenizer, rows: list[dict], max_new_tokens: int,
             temperature: float = 0.0, timeout_s: float = 30.0) -> dict:
    t0 = time.perf_counter()
    pending = []
    for r in rows:
        ids = tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        pending.append(handle.generate.remote(ids, max_new_tokens, temperature))
    correct, lengths, versions = 0, [], set()
    checker = TimedChecker(timeout_s)
    try:
        for r, resp in zip(rows, pending):
            out = resp.result(timeout_s=600)
            text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
            correct += checker(r.get("verifier", "math"), text, r["answer"])[0] > 0
            lengths.append(len(out["output_ids"]))
            versions.update(out["versions"])
    finally:
        checker.close()
    return {"accuracy": correct / max(len(rows), 1), "n": len(rows),
            "mean_len": sum(lengths) / max(len(lengths), 1), "versions": sorted(versions),
            "eval_s": time.perf_counter() - t0}
