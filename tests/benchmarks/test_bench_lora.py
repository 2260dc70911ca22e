"""benchmarks/bench_lora.py runs end to end at a toy size and reports what it claims to
(timings are the benchmark's business, not the test's: no speed is asserted; the byte
and state counts are exact, so those are)."""

import json

from benchmarks.bench_lora import main


def test_bench_lora_writes_its_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "hidden=64", "layers=1", "rank=4", "steps=1", "seqs=4",
                 "seq_len=16"]) == 0
    report = json.loads(out.read_text())
    full, lora = report["results"]["full"], report["results"]["lora"]
    # one layer of hidden 64: q,k,v,o (64x64) and gate,up (192x64), down (64x192), rank 4
    adapter_params = 4 * 4 * (64 + 64) + 3 * 4 * (64 + 192)
    assert lora["push_bytes"] == lora["trainable_param_bytes"] == 4 * adapter_params
    # the state dict names the tied lm_head beside the embedding: a full push counts it twice
    tied_head = 87 * 64 * 4
    assert full["push_bytes"] - tied_head == full["trainable_param_bytes"] == full["param_bytes"]
    # AdamW: m and v of each adapter tensor, and a float32 step count per tensor (7 x A, B)
    assert lora["optimizer_state_bytes"] == 2 * lora["trainable_param_bytes"] + 4 * 14
    assert lora["param_bytes"] == full["param_bytes"] + lora["trainable_param_bytes"]
    assert report["push_bytes_ratio"] > 10 and full["push_s"] > 0 and lora["step_s"] > 0
    assert "bench_lora [" in capsys.readouterr().out


def test_bad_sizes_are_refused(tmp_path, capsys):
    assert main([f"out={tmp_path / 'b.json'}", "seq_len=1"]) == 2
    assert "seq_len must be >= 2" in capsys.readouterr().err
