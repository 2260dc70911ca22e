"""benchmarks/bench_repro.py runs end to end at a toy size and reports what it claims to; the
invariant mode's bit-identity is asserted (that is the mode's promise), speeds are not."""

import json

from benchmarks.bench_repro import group_requests, main


def test_groups_share_a_prompt_and_have_distinct_seeds():
    reqs = group_requests(3, 4, 32, vocab=80)
    assert len({tuple(r.input_ids) for r in reqs[:4]}) == 1
    assert len({r.seed for r in reqs}) == 12 and all(0 <= r.seed < 2**63 for r in reqs)


def test_bench_repro_writes_its_report(tmp_path, capsys):
    out = tmp_path / "repro.json"
    assert main([f"out={out}", "prompts=3", "group_size=3", "max_new_tokens=16", "repeats=1",
                 "checked=4"]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"continuous", "invariant"}
    assert report["results"]["invariant"]["tokens"] == report["results"]["continuous"]["tokens"]
    inv = report["bit_identity_alone_vs_in_traffic"]["invariant"]
    assert inv["ids_and_logprobs_bit_equal"] == inv["checked"] == 4 and inv["max_abs_logprob_diff"] == 0
    assert "invariant_over_continuous" in report and "bench_repro [" in capsys.readouterr().out
