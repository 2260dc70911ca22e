"""jobs/bench_rollout.py runs end to end at a toy size and reports what it claims to
(speeds are the benchmark's business, not the test's: none is asserted). The
benchmark itself fails if any request did not receive its whole budget."""

import json

from jobs.bench_rollout import long_tail_requests, main


def test_budgets_have_a_long_tail():
    budgets = sorted(r.max_new_tokens for r in long_tail_requests(256, 512, vocab=64))
    assert budgets[-1] > 3 * budgets[len(budgets) // 2] and budgets[-1] <= 512


def test_bench_rollout_writes_its_report(ray_cluster, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "requests=16", "max_new_tokens=48", "hidden=32", "layers=1",
                 "push_every=4", "repeats=1"]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"continuous", "static", "serve", "interrupt", "wait"}
    assert {r["tokens"] for r in report["results"].values()} == {
        sum(r.max_new_tokens for r in long_tail_requests(16, 48, vocab=64))}
    assert report["results"]["wait"]["mixed_version_samples"] == 0  # never interrupted
    assert report["results"]["wait"]["resubmits"] == 0
    assert set(report["ratios"]) == {"continuous_over_static", "interrupt_over_wait",
                                     "serve_over_in_process"}
    assert "interruptible" in capsys.readouterr().out
