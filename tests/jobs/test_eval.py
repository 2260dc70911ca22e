"""jobs/eval.py: greedy and sampled pass@k of an agent's answers (through the run's OpenAI
endpoint), a JSON report and an MLflow run; a bad model path is a clear error before
anything starts."""

import json

import mlflow

from jobs.eval import main


def test_a_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["eval.model_path=" + str(tmp_path / "nope")]) == 2
    assert "eval.model_path" in (err := capsys.readouterr().err) and "no config.json" in err


def test_eval_of_an_agent_workflow_starts_the_endpoint_it_talks_to_and_reports_pass_at_k(
        ray_cluster, tmp_path, capsys):
    """conf/agents_sdk.yaml's workflow is an OpenAI Agents SDK agent (examples/
    agents_sdk_agent.py, run unchanged): jobs.eval must serve it the run's OpenAI endpoint
    (URL and key filled in as a run does) and grade what it answers. The SDK sends
    `tools=` to a real Serve app, the endpoint parses the warm-started model's hermes
    calls into `tool_calls`, the SDK runs the calculator and sends the result back.
    The report: greedy and sampled pass@k in the JSON file, the MLflow run and the output
    line. (The built-in workflow's eval: the quickstart notebook's.)"""
    import socket

    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.shutdown()  # Serve's proxy is chosen when it starts: this job starts it with one
    out, store = tmp_path / "eval.json", f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        assert main(["--config", "conf/agents_sdk.yaml", "task.n_eval=6", "eval.k=8",
                     f"rollout.openai.port={port}", "rollout.openai.host=127.0.0.1",
                     f"eval.out={out}", f"run.mlflow_tracking_uri={store}", "run.name=evalagent"]) == 0
    finally:
        serve.shutdown()
    report = json.loads(out.read_text())
    assert report["problems"] == 6 and report["k"] == 8
    assert 0 <= report["sampled_pass@1"] <= report["sampled_pass@8"] <= 1
    run = mlflow.MlflowClient(tracking_uri=store).get_run(report["mlflow_run_id"])
    assert run.data.metrics["sampled_pass_at_8"] == report["sampled_pass@8"]
    assert run.data.params["eval.k"] == "8"
    assert "pass@8" in capsys.readouterr().out
    # the agent called the calculator through the endpoint's sessions (the warm start
    # samples a call for about half of the answers): without the endpoint every episode
    # would have failed and nothing would be graded; without the parsed `tool_calls`
    # the SDK would have run no tool
    assert report.get("tool_use_rate_greedy", 0) + report["tool_use_rate_sampled"] > 0
    # a sampled answer is right ~14% of the time (pass@1 0.08-0.25 over 7 runs here), so 24
    # samples all failed once in CI (0.86^24 ~ 3%); 48 make that ~0.1% at the same cost
    # (the episodes run concurrently)
    assert 0 <= report["greedy_pass@1"] <= 1 and report["sampled_pass@8"] > 0
