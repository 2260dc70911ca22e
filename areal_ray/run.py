"""One asynchronous RL run, top to bottom: what `python -m jobs.train` executes.

  validate config and data -> join or start Ray -> driver actor -> rollout Serve app
  -> eval before -> Ray Data pipeline + Ray Train fit (steps tailed from the driver
  into steps.jsonl, the console and MLflow) -> eval after -> summary.json -> clean up.

Everything that can be checked (config, model path, dataset rows) is checked before
the cluster is touched, so bad input fails in seconds with a message naming it.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import ray
from ray import serve
from ray.data import DataContext
from ray.train import DataConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from areal_ray.config import Config
from areal_ray.data.pipeline import build_pipeline
from areal_ray.data.prompts import eval_rows, train_rows
from areal_ray.driver import Driver
from areal_ray.eval import evaluate
from areal_ray.tracking import RunTracker
from areal_ray.train.loop import train_loop_per_worker
from deployments.rollout import DEPLOYMENT_NAME, build_app

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL = "artifacts/tiny"


def resolve_model(path: str) -> str:
    """Absolute model dir; the embedded tiny model is built on first use."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if not (p / "config.json").exists():
        if Path(path) == Path(EMBEDDED_MODEL):
            from areal_ray.task.tiny_model import TinyModelSpec, build_tiny
            print(f"[areal-ray] building the embedded tiny model in {p} (once)", flush=True)
            build_tiny(p, TinyModelSpec())
        else:
            raise FileNotFoundError(f"model.path {path!r} has no config.json: not an HF model directory")
    return str(p.resolve())


def init_ray(cfg: Config) -> None:
    """Join the job's cluster, a named one, or start a private local one.

    Inside `ray job submit` (RAY_ADDRESS set) the job's runtime env already ships the
    working dir to every worker. Attaching to a named cluster from outside a job
    (e.g. a notebook) ships this repository as the working dir (.gitignore'd paths
    excluded). A local cluster only needs the repository on PYTHONPATH.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS") and not cfg.run.ray_address:
        ray.init(logging_level="WARNING")
    elif cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, logging_level="WARNING",
                 runtime_env={"working_dir": str(REPO_ROOT)})
    else:
        env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               "TOKENIZERS_PARALLELISM": "false"}
        ray.init(address="local", num_cpus=cfg.run.num_cpus or None, include_dashboard=False,
                 runtime_env={"env_vars": env}, logging_level="WARNING")


class StepTail:
    """Polls the driver for step records and hands them to the tracker as they land."""

    def __init__(self, driver, tracker: RunTracker, period_s: float = 0.5):
        self.driver, self.tracker, self.period_s = driver, tracker, period_s
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pull(self) -> None:
        for rec in ray.get(self.driver.steps.remote(len(self.records))):
            prev = self.records[-1]["time_s"] if self.records else 0.0
            rec["step_s"] = rec["time_s"] - prev
            self.records.append(rec)
            self.tracker.log_step(rec)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._pull()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self._pull()
        return self.records


def run_training(cfg: Config) -> dict:
    t_start = time.time()
    model_path = resolve_model(cfg.model.path)
    prompts = train_rows(cfg.task, cfg.train.steps * cfg.algo.batch_groups)
    held_out = eval_rows(cfg.task)
    run_dir = Path(cfg.run.run_dir or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    init_ray(cfg)
    tracker = RunTracker(cfg, run_dir)
    print(f"[areal-ray] run dir {run_dir}  mlflow run {tracker.run_id}", flush=True)
    tag = uuid.uuid4().hex[:8]
    namespace = ray.get_runtime_context().namespace
    driver_name, app_name = f"areal-driver-{tag}", f"areal-rollout-{tag}"
    driver = Driver.options(name=driver_name).remote(
        cfg.algo.eta, cfg.algo.batch_groups, cfg.rollout.max_concurrent_rollouts,
        cfg.run.push_timeout_s)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    try:
        serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(
            model_path, driver_name, namespace, min_replicas=cfg.rollout.min_replicas,
            max_replicas=cfg.rollout.max_replicas,
            max_ongoing_requests=cfg.rollout.max_ongoing_requests,
            max_batch_size=cfg.rollout.max_batch_size, num_cpus=cfg.rollout.num_cpus,
            dtype=cfg.model.dtype, torch_threads=cfg.rollout.torch_threads),
            name=app_name, route_prefix=None)
        before = evaluate(handle, tokenizer, held_out, cfg.rollout.max_new_tokens) \
            if cfg.run.eval_before else None
        if before:
            print(f"[areal-ray] eval before: accuracy {before['accuracy']:.3f} (n={before['n']})", flush=True)

        DataContext.get_current().enable_progress_bars = False  # one line per step instead
        ds = build_pipeline(prompts, cfg, model_path, driver_name, namespace, app_name, DEPLOYMENT_NAME)
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"cfg": cfg, "driver_name": driver_name, "namespace": namespace,
                               "model_path": model_path},
            scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=False,
                                         resources_per_worker={"CPU": cfg.train.num_cpus_per_worker}),
            datasets={"train": ds},
            dataset_config=DataConfig(enable_shard_locality=False),
            run_config=RunConfig(name=f"train-{tag}", storage_path=str(run_dir / "ray_train")))
        tail = StepTail(driver, tracker)
        t_train = time.time()
        try:
            trainer.fit()
        finally:
            steps = tail.stop()
        train_s = time.time() - t_train

        after = evaluate(handle, tokenizer, held_out, cfg.rollout.max_new_tokens) \
            if cfg.run.eval_after else None
        if after:
            print(f"[areal-ray] eval after: accuracy {after['accuracy']:.3f} (n={after['n']})", flush=True)
        final_dir = save_final_model(driver, model_path, run_dir / "final_model")
        summary = summarize(cfg, steps, before, after, train_s, time.time() - t_start)
        summary.update({"run_dir": str(run_dir), "final_model": str(final_dir),
                        "mlflow_run_id": tracker.run_id})
        tracker.finish(summary)
        print(f"[areal-ray] done: {summary['steps']} steps in {summary['wall_s']:.0f}s, "
              f"accuracy {summary['eval_accuracy_before']} -> {summary['eval_accuracy_after']}, "
              f"max staleness {summary['max_staleness']} (eta {cfg.algo.eta})", flush=True)
        return summary
    except BaseException:
        tracker.fail()
        raise
    finally:
        try:
            serve.delete(app_name)
        except Exception:  # noqa: BLE001 - cleanup must not hide the real error
            pass
        ray.kill(driver)


def save_final_model(driver, model_path: str, out: Path) -> Path:
    _, weights = ray.get(driver.latest_weights.remote())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    if weights is not None:
        model.load_state_dict(ray.get(weights[0]), strict=False)
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(model_path).save_pretrained(str(out))
    return out


def summarize(cfg: Config, steps: list[dict], before, after, train_s: float, wall_s: float) -> dict:
    n_samples = sum(s["n_samples"] for s in steps)
    n_tokens = sum(s["n_tokens"] for s in steps)
    return {
        "steps": len(steps), "eta": cfg.algo.eta,
        "eval_accuracy_before": before["accuracy"] if before else None,
        "eval_accuracy_after": after["accuracy"] if after else None,
        "wall_s": wall_s, "train_s": train_s,
        "samples_per_s": n_samples / train_s if train_s else 0.0,
        "tokens_per_s": n_tokens / train_s if train_s else 0.0,
        "max_staleness": max((s["staleness_max"] for s in steps), default=0),
        "mean_staleness": sum(s["staleness_mean"] for s in steps) / max(len(steps), 1),
        "reward_first": steps[0]["reward_mean"] if steps else None,
        "reward_last": steps[-1]["reward_mean"] if steps else None,
        "n_samples": n_samples, "n_tokens": n_tokens,
    }
