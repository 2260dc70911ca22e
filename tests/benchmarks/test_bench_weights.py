"""benchmarks/bench_weights.py at a toy size on the shared cluster: every path delivers the
right weights to every receiver and the report has what the summary claims (no speed
is asserted: that is the benchmark's business)."""

import json

from benchmarks.bench_weights import main


def test_bench_weights_writes_its_report(ray_cluster, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main([f"out={out}", "params=[8e6]", "replicas=[2]", "bucket_mb=4"]) == 0
    report = json.loads(out.read_text())
    assert [r["path"] for r in report["results"]] == ["collective", "object_store", "disk", "shm"]
    for r in report["results"]:
        assert r["replicas"] == 2 and r["params"] == 8_000_000 and r["bytes"] == 32_000_000
        assert r["bytes_per_s_per_replica"] > 0 and r["of_memcpy"] > 0
    assert report["memcpy_bytes_per_s"] > 0
    assert "collective" in capsys.readouterr().out
