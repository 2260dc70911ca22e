"""benchmarks/bench_train.py runs end to end at a toy size and reports what it claims to
(timings are the benchmark's business, not the test's: no speed is asserted)."""

import json

from benchmarks.bench_train import long_tail_batch, main


def test_long_tail_batch_is_a_long_tail():
    seqs = long_tail_batch(groups=16, group_size=8, max_len=512)
    lengths = sorted(len(s["output_ids"]) for s in seqs)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # the tail is far above the median
    assert all(len(s["prompt_ids"]) + len(s["output_ids"]) <= 512 for s in seqs)


def test_bench_train_writes_its_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "groups=4", "group_size=2", "hidden=64", "layers=1",
                 "max_len=64", "repeats=1"]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"packed", "padded", "minibatches4_recompute",
                                      "minibatches4_loglinear"}
    assert report["results"]["minibatches4_recompute"]["prox_s"] > 0
    assert report["results"]["minibatches4_loglinear"]["prox_s"] == 0  # no extra pass
    assert "packed" in capsys.readouterr().out
