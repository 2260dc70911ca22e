"""benchmarks/bench_rollout.py runs end to end at a toy size and reports what it claims to
(speeds are the benchmark's business, not the test's: none is asserted). The
benchmark itself fails if any request did not receive its whole budget."""

import json

import pytest

from benchmarks.bench_rollout import long_tail_requests, main


def test_budgets_have_a_long_tail():
    budgets = sorted(r.max_new_tokens for r in long_tail_requests(256, 512, vocab=64))
    assert budgets[-1] > 3 * budgets[len(budgets) // 2] and budgets[-1] <= 512


def test_bench_rollout_writes_its_report(ray_cluster, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "requests=16", "max_new_tokens=48", "hidden=32", "layers=1",
                 "push_every=4", "repeats=1", "backends=[hf]"]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"hf", "hf_static", "hf_serve", "hf_interrupt", "hf_wait"}
    assert {r["tokens"] for r in report["results"].values()} == {
        sum(r.max_new_tokens for r in long_tail_requests(16, 48, vocab=64))}
    assert report["results"]["hf_wait"]["mixed_version_samples"] == 0  # never interrupted
    assert report["results"]["hf_wait"]["resubmits"] == 0
    assert report["results"]["hf"]["cpu_s"] > 0
    assert set(report["ratios"]) == {"hf_continuous_over_static", "hf_interrupt_over_wait",
                                     "hf_serve_over_in_process"}
    assert "hf_interrupt_over_wait" in capsys.readouterr().out


def test_bench_rollout_runs_the_real_vllm_engine(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "requests=16", "max_new_tokens=48", "hidden=32", "layers=1",
                 "push_every=4", "repeats=1", "backends=[vllm]", "serve=false"]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"vllm", "vllm_offline", "vllm_interrupt", "vllm_wait"}
    assert report["results"]["vllm_wait"]["resubmits"] == 0
    assert report["results"]["vllm_interrupt"]["pushes"] == 3  # at 4, 8 and 12 of 16 samples
    assert set(report["ratios"]) == {"vllm_over_vllm_offline", "vllm_interrupt_over_wait"}


def test_bench_rollout_refuses_an_unknown_backend(capsys):
    assert main(["backends=[tgi]"]) == 2
    assert "backends" in capsys.readouterr().err
