"""Entry point: evaluate a model on the held-out split: greedy pass@1, and sampled
pass@1 and pass@k.

    python -m jobs.eval --config conf/quickstart.yaml eval.model_path=runs/<run>/final_model
    ray job submit --working-dir . -- python -m jobs.eval --config conf/quickstart.yaml

The model (a run's `final_model/`, a checkpoint's `model/`, or the base model when
`eval.model_path` is empty) is served by the same rollout Serve app as in training,
without a driver, generated and graded as training does (the run's workflow and
`reward.*` settings; with `rollout.openai.enabled` behind the OpenAI endpoint, which an
agent workflow talks to). Writes a JSON report and one MLflow run (the resolved config as params, the figures as metrics, the
report as an artifact).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

from areal_ray.run.event_loop import off_event_loop
from jobs.cli import run_job


@off_event_loop
def run_eval(cfg) -> dict:
    import mlflow

    from areal_ray.cluster.placement import check_placement, delete_app
    from areal_ray.data.prompts import eval_rows
    from areal_ray.observe.tracking import params_of, use_experiment
    from areal_ray.reward.registry import check_checkers
    from areal_ray.reward.sandbox import ENV as SANDBOX_ENV
    from areal_ray.reward.sandbox import check_sandbox
    from areal_ray.rollout.workflows.agent import resolve_endpoint
    from areal_ray.run.eval import evaluate
    from areal_ray.run.job import init_ray, resolve_model, start_rollout_app
    from areal_ray.task.tokenizer import load_tokenizer

    model_path = resolve_model(cfg.eval.model_path or cfg.model.path,
                               "eval.model_path" if cfg.eval.model_path else "model.path")
    rows = eval_rows(cfg.task, check_checkers(cfg.reward.checkers))
    out = Path(cfg.eval.out or f"runs/eval-{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    check_sandbox(cfg)  # as training: model-written code runs isolated, or the config says it need not
    os.environ[SANDBOX_ENV] = cfg.reward.sandbox  # the workflow's tools follow it, as in training
    resolve_endpoint(cfg)  # an agent workflow's base_url and key, as a run's
    init_ray(cfg)
    if cfg.run.check_placement:
        check_placement(cfg, training=False)
    tokenizer = load_tokenizer(model_path)
    app = f"areal-eval-{uuid.uuid4().hex[:8]}"
    try:
        # the training run's app without a driver: the endpoint too where the config has it
        handle = start_rollout_app(cfg, model_path, driver_name="", namespace="", app_name=app)
        # generated and graded as the run trains (rollout.*, reward.*): run/eval.py
        greedy = evaluate(handle, tokenizer, rows, cfg)
        ks = sorted({1, cfg.eval.k})
        sampled = evaluate(handle, tokenizer, rows, cfg, temperature=cfg.eval.temperature,
                           samples=cfg.eval.k, ks=tuple(ks))
    finally:
        delete_app(app)
    metrics = {"greedy_pass@1": greedy["accuracy"],
               **{f"sampled_pass@{k}": sampled[f"pass@{k}"] for k in ks},
               "mean_len_greedy": greedy["mean_len"], "mean_len_sampled": sampled["mean_len"]}
    for name, got in (("greedy", greedy), ("sampled", sampled)):
        if "tool_use_rate" in got:  # a tool or agent workflow: how often its answers used tools
            metrics[f"tool_use_rate_{name}"] = got["tool_use_rate"]
    report = {"model": model_path, "problems": len(rows), "k": cfg.eval.k,
              "temperature": cfg.eval.temperature, **metrics,
              "eval_s": greedy["eval_s"] + sampled["eval_s"]}
    use_experiment(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    with mlflow.start_run(run_name=f"eval-{cfg.run.name}") as run:
        report["mlflow_run_id"] = run.info.run_id
        out.write_text(json.dumps(report, indent=2))
        mlflow.log_params(params_of(cfg))
        # MLflow metric names cannot hold "@"
        mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in metrics.items()})
        mlflow.log_artifact(str(out))
    print(f"[areal-ray] eval of {model_path}: greedy pass@1 {metrics['greedy_pass@1']:.3f}, "
          + ", ".join(f"pass@{k} {metrics[f'sampled_pass@{k}']:.3f}" for k in ks)
          + f" (T={cfg.eval.temperature}, {len(rows)} problems) -> {out}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, "python -m jobs.eval",
                   "Held-out greedy pass@1 and sampled pass@1/pass@k of a model or checkpoint.",
                   run_eval)


if __name__ == "__main__":
    sys.exit(main())
