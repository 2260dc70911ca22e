"""One SFT run, top to bottom: what `python -m jobs.sft` executes.

  validate config, model and every row (tokenized here: a bad row fails before the
  cluster is touched) -> the embedded task's greedy accuracy before -> join or start
  Ray -> Ray Train fit (sft/loop.py on the RL trainer's workers) -> accuracy after
  -> summary.json and the MLflow run (`track`)

The run dir holds what an RL run's does where it applies: `config.json` (a resumed
job's config beside it, `config.resume-N.json`),
`steps.jsonl` (a record per step and per held-out evaluation), `summary.json`,
`train/` (Ray Train's checkpoints, `train.checkpoint_every`; `run.resume=true`
continues from the latest) and `final_model/`, an HF model directory in the RL run's
format, which `jobs.train` starts from with `model.path=<run_dir>/final_model`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from areal_ray.config import Config, ConfigError, to_dict
from areal_ray.run.event_loop import off_event_loop
from areal_ray.run.job import TRAIN_DIR, init_ray, resolve_model, worker_resources
from areal_ray.run.resume import write_config_record
from areal_ray.sft.dataset import load_rows
from areal_ray.sft.loop import FINAL_MODEL, STEPS_FILE
from areal_ray.task.tokenizer import load_tokenizer
from areal_ray.train.checkpoint import checkpoint_dirs, nothing_to_resume
from areal_ray.train.entry import sft_loop_per_worker
from areal_ray.train.torch_group import TorchGroupConfig


def total_steps(cfg: Config, n_rows: int) -> int:
    """`sft.epochs` passes over `n_rows` rows in batches of `sft.batch_size`, else `train.steps`."""
    if cfg.sft.epochs > 0:
        return max(1, math.ceil(cfg.sft.epochs * n_rows / cfg.sft.batch_size))
    return cfg.train.steps


def check_run_dir(cfg: Config, run_dir: Path) -> None:
    """A resumed run has a checkpoint to resume from; a new one starts in a dir without
    another run's checkpoints or steps."""
    if cfg.run.resume:
        if (why := nothing_to_resume(run_dir / TRAIN_DIR)) is not None:
            raise ConfigError(f"run.resume=true: {why}")
    elif checkpoint_dirs(run_dir / TRAIN_DIR) or (run_dir / STEPS_FILE).exists():
        raise ConfigError(f"{run_dir} already holds another run's outputs: pass run.resume=true "
                          "to continue it (it needs a checkpoint), or choose another run.run_dir")


def accuracy(cfg: Config, model_dir: str) -> float | None:
    """Greedy accuracy on the RL run's held-out arith problems (data/prompts.py), as the
    warm start measures it (task/tiny_model.py: greedy_accuracy); None for file data."""
    if cfg.sft.train_path or not cfg.sft.accuracy_n:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    from areal_ray.data.prompts import EMBEDDED_EVAL_SEED
    from areal_ray.task import arith
    from areal_ray.task.tiny_model import greedy_accuracy
    t = cfg.task
    problems = arith.make_split(EMBEDDED_EVAL_SEED + t.seed, cfg.sft.accuracy_n,
                                t.max_steps_per_problem, p_stop=t.chain_p_stop)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_accuracy(model, load_tokenizer(model_dir), problems, cfg.sft.max_new_tokens)


def track(cfg: Config, run_dir: Path):
    """The run's MLflow run, opened before the fit so that it shows as running, as an
    RL run's is (observe/tracking.py: open_run)."""
    import mlflow

    from areal_ray.observe.tracking import open_run
    run, _ = open_run(cfg, run_dir, cfg.run.resume)
    mlflow.set_tag("objective", "sft")
    return run


def log_run(cfg: Config, run_dir: Path, records: list[dict], summary: dict) -> None:
    """Per-step and per-eval metrics (by step) not logged by an earlier job of the run,
    the summary's numbers, the run's files and (`run.log_model`) the final model as the
    `model` artifacts."""
    import mlflow
    from mlflow.entities import Metric

    from areal_ray.observe.tracking import numbers
    client, run_id = mlflow.MlflowClient(), mlflow.active_run().info.run_id
    logged = {key: max((m.step for m in client.get_metric_history(run_id, metric)), default=-1)
              for key, metric in (("step", "loss"), ("eval_step", "eval_loss"))}
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, int(r[key]))
               for r in records for key in ("step", "eval_step") if key in r and r[key] > logged[key]
               for k, v in numbers(r, ("step", "eval_step", "t_wall")).items()]
    for i in range(0, len(metrics), 1000):  # MLflow's log_batch takes at most 1000
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    mlflow.log_metrics(numbers(summary))
    for name in (STEPS_FILE, "summary.json", "config.json"):
        if (run_dir / name).exists():
            mlflow.log_artifact(str(run_dir / name))
    if cfg.run.log_model and (run_dir / FINAL_MODEL).exists():
        mlflow.log_artifacts(str(run_dir / FINAL_MODEL), artifact_path="model")


def read_records(run_dir: Path) -> list[dict]:
    """The run's step and eval records, each step's and eval's last: a trainer restarted
    from its checkpoint (`train.max_failures`) writes the steps since then again."""
    path = run_dir / STEPS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    last = {}
    for rec in (json.loads(line) for line in lines if line.strip()):
        last[("step", rec["step"]) if "step" in rec else ("eval", rec["eval_step"])] = rec
    return sorted(last.values(), key=lambda r: (r.get("step", r.get("eval_step")), "step" in r))


@off_event_loop
def run_sft(cfg: Config) -> dict:
    t_start = time.time()
    model_path = resolve_model(cfg.model.path)
    tok = load_tokenizer(model_path)
    rows, held = load_rows(cfg, tok)
    cfg.train.steps = total_steps(cfg, len(rows))  # the LR schedule ends here
    run_dir = Path(cfg.run.run_dir or f"runs/{cfg.run.name}-sft-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    check_run_dir(cfg, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config_record(run_dir, to_dict(cfg), cfg.run.resume)  # config.json, or config.resume-N.json
    print(f"[areal-ray sft] {len(rows)} training rows, {len(held)} held out, {cfg.train.steps} "
          f"steps of {cfg.sft.batch_size} -> {run_dir}", flush=True)
    before = accuracy(cfg, model_path) if not cfg.run.resume else None
    if before is not None:
        print(f"[areal-ray sft] greedy accuracy before: {before:.3f}", flush=True)
    init_ray(cfg)
    trainer = TorchTrainer(
        sft_loop_per_worker,
        torch_config=TorchGroupConfig(),
        train_loop_config={"cfg": cfg, "rows": ray.put(rows), "held_out": ray.put(held),
                           "model_path": model_path, "run_dir": str(run_dir),
                           "checkpoint_root": str(run_dir / TRAIN_DIR)},
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                     resources_per_worker=worker_resources(cfg)),
        run_config=RunConfig(name=TRAIN_DIR, storage_path=str(run_dir),
                             failure_config=FailureConfig(max_failures=cfg.train.max_failures)))
    import mlflow
    run = track(cfg, run_dir)
    try:
        t_train = time.time()
        trainer.fit()
        train_s = time.time() - t_train
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    final = run_dir / FINAL_MODEL
    after = accuracy(cfg, str(final))
    records = read_records(run_dir)
    steps = [r for r in records if "step" in r]
    evals = [r for r in records if "eval_step" in r]
    summary = {"steps": len(steps), "rows": len(rows), "held_out": len(held),
               "loss_first": steps[0]["loss"] if steps else None,
               "loss_last": steps[-1]["loss"] if steps else None,
               "eval_loss_before": evals[0]["eval_loss"] if evals else None,
               "eval_loss_after": evals[-1]["eval_loss"] if evals else None,
               "accuracy_before": before, "accuracy_after": after,
               "train_s": train_s, "wall_s": time.time() - t_start,
               "run_dir": str(run_dir), "final_model": str(final), "mlflow_run_id": run.info.run_id}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log_run(cfg, run_dir, records, summary)
    mlflow.end_run()
    print(f"[areal-ray sft] done: {summary['steps']} steps in {summary['wall_s']:.0f}s, held-out "
          f"loss {summary['eval_loss_before']} -> {summary['eval_loss_after']}, accuracy {before} -> "
          f"{after}; model in {final}", flush=True)
    return summary
