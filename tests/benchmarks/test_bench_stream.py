"""benchmarks/bench_stream.py runs end to end at a toy size and reports what it claims to
(timings are the benchmark's business, not the test's: no speed is asserted)."""

import json

from benchmarks.bench_stream import main


def test_bench_stream_writes_its_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "sizes=[300]", "consume=40", f"data_dir={tmp_path / 'data'}"]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["n"]) for r in results] == [("stream", 300), ("from_items", 300)]
    for r in results:
        assert r["taken"] == 41 and r["rows_in_multi_row_blocks"] == 0
        assert r["first_row_s"] >= r["open_s"] > 0 and r["tree_peak_pss_mib"] > r["job_pss_mib_after"]
    assert "bench_stream stream 300" in capsys.readouterr().out


def test_bad_sizes_are_refused(capsys):
    assert main(["sizes=[0]"]) == 2
    assert "sizes" in capsys.readouterr().err
