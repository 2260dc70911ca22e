"""jobs/bench_peers end to end, short: TRL (installed into .peers/site on first use) and
our job on a shrunk quickstart for 2 steps, every saved model graded by our evaluator,
the report's fields filled from real runs. Speed and accuracy are the bench's to report
(runs/), never asserted here."""

import json
import sys
from pathlib import Path

import yaml

from benchmarks import bench_peers

B, G = 4, 4  # the quickstart's 8 x 8 and its 256 held-out problems shrunk: the paths are the same


def test_bench_peers_runs_both_systems_and_grades_every_saved_model(ray_cluster, tmp_path):
    conf = yaml.safe_load((bench_peers.REPO / "conf" / "quickstart.yaml").read_text())
    conf["algo"]["batch_groups"], conf["rollout"]["group_size"] = B, G
    conf["rollout"]["max_new_tokens"] = 48
    conf["task"] = {"n_eval": 16}
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(conf))
    out = tmp_path / "peers.json"
    assert bench_peers.main(["seeds=[0]", "steps=2", "save_every=1", f"out={out}",
                             f"run_config={tmp_path / 'small.yaml'}"]) == 0
    report = json.loads(out.read_text())
    runs = {r["system"]: r for r in report["runs"]}
    assert set(runs) == {"trl", "ours-eta2"}  # no etas given: one arm at the config's eta
    for r in runs.values():
        assert [m["step"] for m in r["models"]] == [1, 2]  # one saved mid-run, the final one
        assert all(0.0 <= m["accuracy"] <= 1.0 and m["t_launch"] > 0 for m in r["models"])
        assert r["n_samples"] == 2 * B * G and r["samples_per_s"] > 0 and r["peak_pss_gib"] > 0.1
        assert 0 < r["first_step_s"] < r["last_step_s"] < r["wall_s"]
        assert r["cpu_s"] > 0 and r["steady_cpu_s_per_step"] >= 0 and r["steady_samples_per_s"] > 0
        by_process = r["peak_pss_mib_by_process"]  # the peak, process group by group
        assert abs(sum(by_process.values()) - r["peak_pss_gib"] * 1024) < len(by_process)
        assert list(by_process.values()) == sorted(by_process.values(), reverse=True)
    assert Path(sys.executable).name in runs["trl"]["peak_pss_mib_by_process"]  # TRL's one process
    assert {"job", "ray::RayTrainWorker"} <= set(runs["ours-eta2"]["peak_pss_mib_by_process"])
    # TRL's generator idles outside `generate`, and pads every batch to its longest answer
    assert 0 < runs["trl"]["rollout_idle_fraction"] < 1
    assert 0 <= runs["trl"]["padded_row_step_fraction"] < 1
    assert report["summary"]["vs_trl"]["ours-eta2"]["samples_per_s_ours_over_trl"] > 0
    assert "| trl seed 0 |" in out.with_suffix(".md").read_text()
