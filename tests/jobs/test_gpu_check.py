"""jobs/gpu_check on CPU: every piece runs (the train step on a small random model with
its saved bytes against the memory model, a gloo weight push with an absent receiver,
the HF engine's generate/abort/release/update/logprob parity and load probe) and the
report says PASS."""

import json

from jobs import gpu_check


def test_gpu_check_cpu_pieces_pass(random_model_dir, embedded_model, tmp_path):
    out = tmp_path / "gpu_check.json"
    rc = gpu_check.main(["device=cpu", f"model_config={random_model_dir}", "tokens=256",
                         "push_mb=8", "push_timeout_s=2", "engine=hf", "loop_steps=2", "loop_prompts=2", "loop_new_tokens=8", f"engine_model={embedded_model}", f"out={out}"])
    report = json.loads(out.read_text())
    assert rc == 0, report
    pieces = report["pieces"]
    assert {k: v["status"] for k, v in pieces.items()} == {
        "train_step": "PASS", "weight_push": "PASS", "engine": "PASS", "one_gpu": "SKIP",
        "loop": "PASS"}
    step = pieces["train_step"]
    assert step["saved_bytes_per_token"] == step["model_bytes_per_token"]
    assert step["loss"] != 0 and step["grad_norm"] > 0  # the step really moved the weights
    # sdpa: one sequence of the whole budget, so the one micro-batch is the size checked
    assert (step["microbatches"], step["microbatch_tokens"]) == (1, step["tokens"]) and step["tokens"] >= 250
    assert pieces["weight_push"]["push"]["1"]["equal"] is True
    assert "not ready" in pieces["weight_push"]["absent_receiver"]["0"]["message"]
    assert [r["served_versions"] for r in pieces["loop"]["rounds"]] == [[0], [1]]
    assert all(r["microbatches"] >= 1 for r in pieces["loop"]["rounds"])
    engine = pieces["engine"]
    assert engine["aborted"] == "abort" and engine["logprob_max_abs_diff"] <= 1e-3
    # the run config's release round ran, and the load probe judged the push from v0
    assert engine["released"] is True and engine["probe_rule"] == "exact"
    assert engine["probe_gap_v0"] == 0.0 and engine["probe_max_diff"] <= 1e-5


def test_gpu_check_refuses_unknown_pieces(capsys):
    assert gpu_check.main(["pieces=train_step,nccl_magic"]) == 2
    assert "pieces must be among" in capsys.readouterr().err
