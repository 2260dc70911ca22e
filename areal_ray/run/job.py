"""One asynchronous RL run, top to bottom: what `python -m jobs.train` executes.

  validate config and data -> join or start Ray -> driver actor (admissions held)
  -> rollout Serve app deploying | Ray Train fit starting (its workers, the Ray Data
  pipeline) -> replicas running -> eval before -> admissions released (steps tailed
  from the driver into steps.jsonl, the console and MLflow) -> eval after ->
  summary.json -> clean up. (One GPU shared by a replica and the trainer: the
  replicas run before the fit starts; run/startup.py.)

Everything that can be checked (config, model path, dataset rows) is checked before
the cluster is touched, so bad input fails in seconds with a message naming it.
"""

from __future__ import annotations

import importlib.util
import math
import os
import threading
import time
from pathlib import Path

import ray
from ray import serve
from ray.data import DataContext
from ray.train import DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from transformers import AutoModelForCausalLM

from areal_ray.cluster.attention import check_attention, check_attention_on_nodes
from areal_ray.cluster.cleanup import sweep
from areal_ray.cluster.home import job_node, on_node
from areal_ray.cluster.ownership import Owned, new_tag
from areal_ray.cluster.placement import (
    PlacementError,
    bound_train_start,
    check_placement,
    check_run_dir,
    delete_app,
    delete_extra_apps,
    deploy_app,
    train_start_problem,
    wait_for_app,
)
from areal_ray.cluster.roles import NodeRequirement
from areal_ray.cluster.system_config import local_worker_env, system_config
from areal_ray.config import Config, ConfigError, to_dict
from areal_ray.data.pipeline import PipelineFactory
from areal_ray.data.prompts import eval_rows, train_stream
from areal_ray.distill import app as teacher_app
from areal_ray.driver import Driver
from areal_ray.judge.models import resolve_all as served_reward_models
from areal_ray.observe.metrics import JobMetrics
from areal_ray.observe.progress import StepProgress
from areal_ray.observe.tracking import RunTracker, lineage, read_events, unseen_records
from areal_ray.observe.utilization import length_stats, rollout_idle, steady_state
from areal_ray.plugins import check_plugins
from areal_ray.reward.sandbox import ENV as SANDBOX_ENV
from areal_ray.reward.sandbox import check_sandbox
from areal_ray.rollout.workflows.agent import resolve_endpoint
from areal_ray.rollout.workflows.base import SINGLE_TURN
from areal_ray.run.eval import evaluate
from areal_ray.run.event_loop import off_event_loop
from areal_ray.run.interrupt import RunInterrupted, StopOnInterrupt, WorkerThread
from areal_ray.run.resume import check_fresh_run_dir, check_resume_config
from areal_ray.run.startup import sequential_start
from areal_ray.task.tokenizer import load_tokenizer
from areal_ray.train.batch_record import RECORD_DIR, recorded_steps
from areal_ray.train.checkpoint import (
    checkpoint_dirs,
    latest_checkpoint,
    nothing_to_resume,
    read_trainer_state,
    save_hf,
)
from areal_ray.train.driver_watch import DriverWatch, actor_alive
from areal_ray.train.entry import train_loop_per_worker
from areal_ray.train.torch_group import TorchGroupConfig
from areal_ray.weights.encoding import NCCL_ENV, state_from
from areal_ray.weights.group import free_port
from areal_ray.weights.probe import run_probe_rule
from deployments.judge import start_served_rewards
from deployments.openai_api import build_openai_app
from deployments.rollout import DEPLOYMENT_NAME, build_app

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_MODELS = {"artifacts/tiny": "arith", "artifacts/tiny-tools": "tool_arith",
                   "artifacts/tiny-agents": "tool_arith_hermes",
                   "artifacts/tiny-chains": "chain_arith", "artifacts/tiny-bpe": "arith_bpe",
                   "artifacts/tiny-bpe-agents": "tool_arith_bpe_hermes"}  # path: task
TRAIN_DIR = "train"  # Ray Train's run (checkpoints) inside the run dir
FIT_GONE_S = 60.0  # how long a failed job waits for its trainer to stop


def resolve_model(path: str, key: str = "model.path") -> str:
    """Absolute model dir; an embedded tiny model (EMBEDDED_MODELS) is built on first use."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    if not (p / "config.json").exists():
        task = {Path(k): v for k, v in EMBEDDED_MODELS.items()}.get(Path(path))
        if task:
            from areal_ray.task.tiny_model import SPECS, build_tiny
            print(f"[areal-ray] building the embedded tiny model in {p} (once)", flush=True)
            build_tiny(p, SPECS[task]())
        elif not p.is_absolute() and not p.exists():
            raise FileNotFoundError(
                f"{key} {path!r} does not exist: a relative path resolves against the job's working "
                f"directory ({Path.cwd()}; inside `ray job submit`, Ray's copy of --working-dir, which "
                f"leaves out .gitignore'd paths such as models/); use an absolute path")
        else:
            raise FileNotFoundError(f"{key} {path!r} has no config.json: not an HF model directory")
    return str(p.resolve())


def init_ray(cfg: Config) -> None:
    """Join the job's cluster, a named one, or start a private local one.

    Inside `ray job submit` (RAY_ADDRESS set) the job's runtime env already ships the
    working dir to every worker. Attaching to a named cluster from outside a job
    (e.g. a notebook) ships this repository as the working dir (.gitignore'd paths
    excluded). A local cluster's workers run this interpreter, which imports the
    checkout `pip install -e .` installed; REPO_ROOT first on their PYTHONPATH makes them
    import the same checkout as this process also where the venv's install points at
    another one (a git worktree sharing a venv) or where there is none (`python -m`
    from the checkout's root).
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS") and not cfg.run.ray_address:
        ray.init(logging_level="WARNING")
    elif cfg.run.ray_address:
        ray.init(address=cfg.run.ray_address, logging_level="WARNING",
                 runtime_env={"working_dir": str(REPO_ROOT)})
    else:
        # With its dashboard, which the workers are told of (local_worker_env).
        port = free_port()
        ray.init(address="local", num_cpus=cfg.run.num_cpus or None, include_dashboard=True,
                 dashboard_host="127.0.0.1", dashboard_port=port,
                 runtime_env={"env_vars": local_worker_env(str(REPO_ROOT), port)},
                 logging_level="WARNING",
                 _system_config=system_config(cfg.run))  # bounds the GCS's task events
        print(f"[areal-ray] Ray dashboard at http://127.0.0.1:{port}", flush=True)


def trainer_runtime_env(cfg: Config) -> dict:
    """GPU trainers get the NCCL settings the rollout replicas have (areal_ray.weights.encoding)."""
    return {"env_vars": dict(NCCL_ENV)} if cfg.train.use_gpu else {}


class StepTail:
    """Polls the driver for step records and restore events and hands them to the
    tracker and the console (`progress`) as they land; `stop()` returns the surviving
    step records (`lineage`), including those of earlier jobs of a resumed run (`prior`).

    Not Ray Train's `report` + callbacks: those run in its controller actor, not in
    this process; every `report` is a barrier of all ranks and waits for the
    controller's next poll (2 s) when the last one was not taken yet; reports pending
    when a worker dies are dropped; and a report returns nothing, so the Ctrl-C stop
    flag would still need the driver (Ray 2.60, ray/train/v2/_internal/execution)."""

    def __init__(self, driver, tracker: RunTracker, prior: list[dict] = (), period_s: float = 0.5):
        self.driver, self.tracker, self.period_s = driver, tracker, period_s
        self.progress = StepProgress(tracker.cfg.train.steps)
        self.metrics = JobMetrics(tracker.cfg.run.name)
        self.events: list[dict] = list(prior)
        self.start_version: int | None = None  # where this job's trainer started
        self._seen = 0
        self._lost = 0  # rollout replicas the driver found dead, as last said
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pull(self) -> None:
        try:
            events, state = ray.get([self.driver.steps.remote(self._seen),
                                     self.driver.gate_state.remote()])
            self.metrics.since_progress(self.progress.watch(state))  # a stall is said and shown
        except ray.exceptions.RayActorError:
            return  # the driver is gone: the job reports it (driver_lost)
        for ev in events:
            self._seen += 1
            if ev.get("event") == "restore":
                if self.start_version is None:
                    self.start_version = ev["version"]
                unseen = unseen_records(self.events, ev)
                ev = {k: v for k, v in ev.items() if k != "records"}
                if ev["version"] == 0 and not self.events:
                    continue  # a fresh start, nothing to roll back
                self.events.append(ev)
                self.tracker.log_restore(ev)
                self.progress.restarted(ev["version"])
                for rec in unseen:
                    self._step(rec)
            else:
                self._step(ev)

    def _step(self, rec: dict) -> None:
        self.events.append(rec)
        self.tracker.log_step(rec)
        if (lost := rec.get("replicas_lost", 0)) > self._lost:  # this job's driver's count
            self.progress.note(f"[areal-ray] {lost - self._lost} rollout replica(s) lost before "
                               f"v{rec['version']} (its node or process gone); the run goes on "
                               f"with {rec.get('replicas')}")
            self._lost = lost
        self.progress.step(rec)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._pull()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self._pull()
        self.progress.close()
        return lineage(self.events)


def worker_resources(cfg: Config) -> dict:
    """A trainer worker's Ray resources: its CPUs, with `train.use_gpu` its GPU share
    (a fraction when it shares the GPU with a rollout replica), and the custom resources
    that pin it to a node type (`train.resources`, cluster/roles.py)."""
    res = {"CPU": cfg.train.num_cpus_per_worker, **NodeRequirement.of(cfg.train).resources}
    if cfg.train.use_gpu:
        res["GPU"] = cfg.train.num_gpus_per_worker
    return res


def model_shape(model_path: str):
    from transformers import AutoConfig

    from areal_ray.train.memory import DecoderShape
    return DecoderShape.from_hf(AutoConfig.from_pretrained(model_path))


def check_memory(cfg: Config, model_path: str) -> None:
    """With `train.gpu_memory_gib`: refuse a micro-batch budget the memory model says
    does not fit (an OOM an hour in is worse), or pick the largest that does."""
    if cfg.train.gpu_memory_gib <= 0:
        return
    from transformers import AutoConfig

    from areal_ray.train.memory import DecoderShape, plan
    p = plan(cfg, DecoderShape.from_hf(AutoConfig.from_pretrained(model_path)))
    if not p["fits"]:
        raise ConfigError(
            f"algo.microbatch.max_tokens={p['max_tokens_per_mb']} does not fit "
            f"train.gpu_memory_gib={p['gpu_gib']} with a {p['margin']:.0%} margin by the memory "
            f"model (GiB by part: {p['gib']}); the largest that fits is "
            f"{p['largest_max_tokens_per_mb']}, or set train.activation_checkpointing=true")
    if cfg.algo.microbatch.max_tokens == 0:
        cfg.algo.microbatch.max_tokens = p["largest_max_tokens_per_mb"]
    print(f"[areal-ray] trainer memory per GPU by the model: {p['gib']['total']} GiB of "
          f"{p['gpu_gib']} at algo.microbatch.max_tokens={cfg.algo.microbatch.max_tokens}", flush=True)


def check_replay(cfg: Config) -> str:
    """The recorded batches `run.replay` names, as an absolute path (the Train workers
    run elsewhere), once they are known to cover `train.steps`; "" without a replay."""
    if not cfg.run.replay:
        return ""
    root = (Path(cfg.run.replay) / RECORD_DIR).absolute()
    have = recorded_steps(root)
    if have == 0:
        raise ConfigError(f"run.replay: {root} holds no recorded steps (was the run made "
                          "with run.record_batches=true?)")
    if have < cfg.train.steps:
        raise ConfigError(f"run.replay: {root} holds {have} steps; train.steps is "
                          f"{cfg.train.steps} (pass train.steps={have} or fewer)")
    return str(root)


def eval_line(result: dict) -> str:
    line = f"accuracy {result['accuracy']:.3f} (n={result['n']})"
    if "tool_use_rate" in result:
        line += f", tool use {result['tool_use_rate']:.3f}"
    return line


def prompt_count(cfg: Config) -> int:
    """Prompts the pipeline needs: one per trained group, more when groups may be
    dropped (`algo.dynamic_filter.prompt_factor` per trained group): by the dynamic
    filter, or by a workflow of the user's, which may reject rows (the built-in
    single-turn one never does)."""
    n = cfg.train.steps * cfg.algo.batch_groups
    may_drop = cfg.algo.dynamic_filter.enabled or cfg.rollout.workflow != SINGLE_TURN \
        or teacher_app.may_drop(cfg)
    return math.ceil(n * cfg.algo.dynamic_filter.prompt_factor) if may_drop else n


@off_event_loop
def run_training(cfg: Config) -> dict:
    t_start = time.time()
    model_path = resolve_model(cfg.model.path)
    teacher_path = teacher_app.prepare(cfg, model_path)  # algo.distill: built on first use
    served_models = served_reward_models(cfg.reward)  # reward.judge, reward.reward_model: built on first use
    check_memory(cfg, model_path)
    check_lora_targets(cfg, model_path)
    check_attention(cfg.model.attn_implementation, cfg.train.use_gpu)  # before any worker loads it
    resolve_endpoint(cfg)  # the endpoint's key; an agent workflow's base_url and api_key
    verifiers = check_plugins(cfg)  # rollout.workflow, reward.checkers: bad paths fail here
    prompts = train_stream(cfg.task, prompt_count(cfg), verifiers)
    held_out = eval_rows(cfg.task, verifiers)
    run_dir = Path(cfg.run.run_dir or f"runs/{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    resume = cfg.run.resume
    if resume:
        check_resume(cfg, run_dir)
    elif checkpoint_dirs(run_dir / TRAIN_DIR):
        raise ConfigError(f"{run_dir} already holds checkpoints of a run: pass run.resume=true "
                          "to continue it, or choose another run.run_dir")
    else:  # recorded batches, a step log (resume.py)
        check_fresh_run_dir(run_dir, RECORD_DIR)
    replay_dir = check_replay(cfg)
    check_sandbox(cfg)  # model-written code runs isolated, or the config says it need not
    os.environ[SANDBOX_ENV] = cfg.reward.sandbox  # the in-process eval's tools follow it too
    init_ray(cfg)
    # What killed jobs left (their Serve apps, weight files) would otherwise hold this
    # cluster's CPUs, GPUs and shared memory for good; before the placement check.
    try:
        lines = sweep().lines()
    except Exception as e:  # noqa: BLE001 - others' leftovers must not stop this run
        lines = [f"not checked: the sweep failed ({type(e).__name__}: {e}); "
                 "`python -m jobs.cleanup` retries it"]
    for line in lines:
        print(f"[areal-ray] clean-up: {line}", flush=True)
    # each GPU node's own packages and kernel cache, where Train workers may land
    check_attention_on_nodes(cfg.model.attn_implementation, cfg.train.use_gpu)
    if cfg.run.check_placement:  # before anything is deployed
        check_placement(cfg, model_shape(model_path) if cfg.train.gpu_memory_gib > 0 else None)
    check_run_dir(cfg, str(run_dir))  # Ray Train's storage: shared when the run spans nodes
    tracker = RunTracker(cfg, run_dir, resume=resume)
    print(f"[areal-ray] run dir {run_dir}  mlflow run {tracker.run_id}", flush=True)
    owned = Owned(new_tag())  # everything this job creates that could outlive it is named from it
    namespace = ray.get_runtime_context().namespace
    driver_name, app_name = owned.driver_name, owned.app_name
    # Overlapped (run/startup.py), the trainer starts beside the replicas, and the
    # driver holds admissions until the eval before has measured the initial weights.
    why_sequential = sequential_start(cfg)
    eval_before = cfg.run.eval_before and not resume  # a resumed run's was its first job's
    # The run's own parts live on the job's node: losing another node loses replicas
    # (or trainer workers), never the driver or the pipeline (cluster/home.py).
    home = job_node()
    driver = Driver.options(name=driver_name, **on_node(home)).remote(
        cfg.algo.eta, cfg.algo.batch_groups, cfg.rollout.max_concurrent_rollouts,
        cfg.run.push_timeout_s, cfg.run.name, ordered=cfg.run.deterministic,
        held=why_sequential is None and eval_before, probe=run_probe_rule(cfg))
    tokenizer = load_tokenizer(model_path)
    fit = None
    try:
        handle = start_rollout_app(cfg, model_path, driver_name, namespace, app_name,
                                   wait=why_sequential is not None)
        teacher_app.start(cfg, teacher_path, app_name)
        # the served rewards' apps run before any group is graded (deployments/judge.py)
        start_served_rewards(cfg.reward, served_models, owned, cfg.run.placement_timeout_s)
        if why_sequential is not None:
            print(f"[areal-ray] the trainer starts once the replicas run: {why_sequential}", flush=True)

        DataContext.get_current().enable_progress_bars = False  # ours instead (progress.py)
        # A replay trains on the recorded batches: no pipeline, no generation.
        datasets = {} if replay_dir else {"train": PipelineFactory(
            prompts, cfg, driver_name, namespace, app_name, DEPLOYMENT_NAME, home)}
        trainer = TorchTrainer(
            train_loop_per_worker,
            torch_config=TorchGroupConfig(),  # the controller needs no torch (train/torch_group.py)
            train_loop_config={"cfg": cfg, "driver_name": driver_name, "namespace": namespace,
                               "model_path": model_path, "checkpoint_root": str(run_dir / TRAIN_DIR),
                               "weights_dir": str(run_dir / "weights"),
                               "batches_dir": str(run_dir / RECORD_DIR), "replay_dir": replay_dir},
            scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                         resources_per_worker=worker_resources(cfg),
                                         label_selector=NodeRequirement.of(cfg.train).labels or None),
            datasets=datasets,
            dataset_config=DataConfig(enable_shard_locality=False),
            # A fixed name under the run dir: a new job with the same run dir (run.resume)
            # finds the checkpoints, and Ray Train hands the latest to the workers.
            run_config=RunConfig(name=TRAIN_DIR, storage_path=str(run_dir),
                                 # A worker group that cannot be placed by the deadline
                                 # ends the job (Ray Train would retry it forever).
                                 failure_config=FailureConfig(max_failures=cfg.train.max_failures,
                                                              controller_failure_limit=0),
                                 callbacks=[DriverWatch(driver_name, namespace)],
                                 worker_runtime_env=trainer_runtime_env(cfg)))
        prior = lineage(read_events(tracker.steps_path)) if resume else []
        tail = StepTail(driver, tracker, prior=prior)
        stopper = StopOnInterrupt(lambda: driver.request_stop.remote(), notice=tail.progress.note)
        bound_train_start(cfg.run.placement_timeout_s)
        teacher_app.wait(cfg, app_name)  # before any prompt is admitted
        before = None
        if why_sequential is not None and eval_before:
            before = report_eval("before", evaluate(handle, tokenizer, held_out, cfg))
        t_train = time.time()
        try:
            with stopper:
                fit = WorkerThread(trainer.fit)
                if why_sequential is None:
                    wait_for_app(app_name, cfg.run.placement_timeout_s)
                    if eval_before:
                        before = report_eval("before", evaluate(handle, tokenizer, held_out, cfg))
                        ray.get(driver.release_admissions.remote())
                fit.result()
        except Exception as e:
            if not actor_alive(driver, timeout_s=10):
                raise RuntimeError(driver_lost(driver_name, cfg, run_dir)) from e
            if (unplaced := train_start_problem(e, cfg)) is not None:
                raise PlacementError(unplaced) from e
            raise
        finally:
            steps = tail.stop()
        train_s = time.time() - t_train
        if stopper.requested:
            last = steps[-1]["version"] if steps else 0
            where = (f"checkpoint at version {last} in {run_dir / TRAIN_DIR}; continue with "
                     f"run.run_dir={run_dir} run.resume=true") if cfg.train.checkpoint_every \
                else "no checkpoint (train.checkpoint_every=0)"
            raise RunInterrupted(f"stopped after version {last}: {where}")

        # The trained model is on disk before anything else can fail: an evaluation
        # that raises (an endpoint replica crashing as the pipeline shuts down) must
        # not lose the run's result.
        final_dir = save_final_model(driver, model_path, run_dir / "final_model", cfg)
        after = report_eval("after", evaluate(handle, tokenizer, held_out, cfg)) \
            if cfg.run.eval_after else None
        n_prior = sum(r["version"] <= (tail.start_version or 0) for r in steps)
        loads = ray.get(driver.replica_loads.remote())
        summary = summarize(cfg, steps, before, after, train_s, time.time() - t_start, n_prior)
        if len(steps) > n_prior and "t_wall" in steps[n_prior]:
            # from this call (config read, nothing started) to this job's first step
            summary["first_step_s"] = steps[n_prior]["t_wall"] - t_start
        summary.update(utilization(steps[n_prior:], loads))
        summary.update({"run_dir": str(run_dir), "final_model": str(final_dir),
                        "mlflow_run_id": tracker.run_id})
        tracker.finish(summary, steps, final_dir)
        print(f"[areal-ray] done: {summary['steps']} steps in {summary['wall_s']:.0f}s, "
              f"accuracy {summary['eval_accuracy_before']} -> {summary['eval_accuracy_after']}, "
              f"max staleness {summary['max_staleness']} (eta {cfg.algo.eta})", flush=True)
        return summary
    except BaseException:
        tracker.fail()
        raise
    finally:
        try:
            delete_app(app_name)
        except Exception:  # noqa: BLE001 - cleanup must not hide the real error
            pass
        try:
            delete_extra_apps(owned)  # the judge's, the reward model's and the teacher's apps
        except Exception:  # noqa: BLE001 - cleanup must not hide the real error
            pass
        ray.kill(driver)
        # A run that failed while its trainer was starting (the replicas were never
        # placed, the eval raised): without the driver, DriverWatch ends the fit.
        if fit is not None and not fit.join(FIT_GONE_S):
            print(f"[areal-ray] the trainer did not stop within {FIT_GONE_S:g} s of the driver's "
                  "end; Ray ends its actors with the job", flush=True)


def report_eval(when: str, result: dict) -> dict:
    print(f"[areal-ray] eval {when}: {eval_line(result)}", flush=True)
    return result


def start_rollout_app(cfg: Config, model_path: str, driver_name: str, namespace: str,
                      app_name: str, wait: bool = True):
    """Start the rollout Serve app; the handle of its Rollout deployment (with `wait`
    once the app runs; without, the caller waits with `wait_for_app`). With
    `rollout.openai.enabled` the app's ingress is the OpenAI endpoint
    (deployments/openai_api.py) behind Serve's HTTP proxy on `rollout.openai.port`,
    so the Rollout deployment is looked up by name rather than taken from `serve.run`.
    Serve's proxy settings are the cluster's: on a cluster where Serve already runs,
    `serve.start` keeps the ones it was started with."""
    app = build_app(cfg, model_path, driver_name, namespace)
    endpoint = cfg.rollout.openai
    if endpoint.enabled:
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": endpoint.host, "port": endpoint.port})
        deploy_app(build_openai_app(cfg, app, model_path), app_name, cfg.run.placement_timeout_s,
                   route_prefix=endpoint.route_prefix, wait=wait)
        # That a key exists and where it comes from; never the key itself.
        print(f"[areal-ray] OpenAI endpoint at {endpoint.base_url(ray.util.get_node_ip_address())}"
              "/sessions/<sid>/v1, bearer key rollout.openai.api_key (when not set in the config: "
              "a random one, passed to the workflow only)", flush=True)
    else:
        serve.start(proxy_location="Disabled")
        deploy_app(app, app_name, cfg.run.placement_timeout_s, wait=wait)
    return serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=app_name)


def check_resume(cfg: Config, run_dir: Path) -> None:
    """Before the cluster is touched: a resume needs a checkpoint that verifies, and a
    config that agrees with the run's on what the checkpoint refers to (resume.py)."""
    if (why := nothing_to_resume(run_dir / TRAIN_DIR)) is not None:
        raise ConfigError(f"run.resume: {why} (train.checkpoint_every must be > 0 in the run "
                          "to resume)")
    changes = check_resume_config(run_dir, to_dict(cfg), cfg.run.resume_allow_changes)
    for key, (old, new) in changes.items():
        print(f"[areal-ray] resuming with {key} changed: {old!r} -> {new!r} "
              "(run.resume_allow_changes)", flush=True)


def driver_lost(driver_name: str, cfg: Config, run_dir: Path) -> str:
    """What to tell the user when the driver actor died: where the run can resume."""
    last = latest_checkpoint(run_dir / TRAIN_DIR)
    if last is None:
        where = ("no checkpoint to resume from (train.checkpoint_every=0)" if not cfg.train.checkpoint_every
                 else "no checkpoint had been written yet")
    else:
        where = (f"continue from its last checkpoint (version {read_trainer_state(last)['version']}) "
                 f"with run.run_dir={run_dir} run.resume=true")
    return (f"the driver actor {driver_name} died; a run cannot go on without it (it holds the "
            f"staleness gate and the weight publications): {where}")


def check_lora_targets(cfg: Config, model_path: str) -> None:
    """model.lora's targets against the model's config (no weights read), before Ray.
    peft must be installed too: without it every Train worker fails on `import peft`,
    and only after the rollout app has started and the pre-training eval has run."""
    if cfg.model.lora.enabled:
        if importlib.util.find_spec("peft") is None:
            raise ConfigError("model.lora.enabled needs the peft package, which is not installed in "
                              "this environment: pip install peft==0.21.2 (requirements*.txt pin it), "
                              "or set model.lora.enabled=false")
        from areal_ray.train.lora import check_model_targets
        try:
            check_model_targets(model_path, list(cfg.model.lora.target_modules))
        except ValueError as e:
            raise ConfigError(str(e)) from None


def save_final_model(driver, model_path: str, out: Path, cfg: Config) -> Path:
    """The last published weights in HF format; with LoRA the last adapter merged into
    the base, and the adapter alone in peft's format in `out/adapter`."""
    _, weights = ray.get(driver.latest_weights.remote())
    if weights is None:  # nothing was trained: the initial model
        return save_hf(AutoModelForCausalLM.from_pretrained(model_path).state_dict(), model_path, out)
    if cfg.model.lora.enabled:
        from areal_ray.train.lora import save_lora_model
        from areal_ray.weights.adapter import Adapter
        from areal_ray.weights.payloads import AdapterMeta
        meta = AdapterMeta.from_config(cfg.model.lora, model_path)
        return save_lora_model(Adapter(meta, state_from(ray.get(weights[0]))), model_path, out)
    return save_hf(state_from(ray.get(weights[0])), model_path, out)


def utilization(steps: list[dict], loads: dict[str, list[dict]]) -> dict:
    """Steady-state throughput, trainer and rollout idle fractions and the output
    lengths of this job's steps (areal_ray/observe/utilization.py)."""
    out = {**steady_state(steps),
           **length_stats([n for s in steps for n in s.get("output_lens", [])])}
    if len(steps) >= 2 and "t_wall" in steps[0]:
        out.update(rollout_idle(loads, steps[0]["t_wall"], steps[-1]["t_wall"]))
    return out


def summarize(cfg: Config, steps: list[dict], before, after, train_s: float, wall_s: float,
              n_prior: int = 0) -> dict:
    """`steps`: the run's surviving step records; the first `n_prior` of them came from
    earlier jobs of a resumed run and do not count towards this job's throughput."""
    n_samples = sum(s["n_samples"] for s in steps)
    n_tokens = sum(s["n_tokens"] for s in steps)
    mine = steps[n_prior:]
    return {
        "steps": len(steps), "eta": cfg.algo.eta, "resumed_at_step": n_prior or None,
        "eval_accuracy_before": before["accuracy"] if before else None,
        "eval_accuracy_after": after["accuracy"] if after else None,
        "wall_s": wall_s, "train_s": train_s,
        "samples_per_s": sum(s["n_samples"] for s in mine) / train_s if train_s else 0.0,
        "tokens_per_s": sum(s["n_tokens"] for s in mine) / train_s if train_s else 0.0,
        "max_staleness": max((s["staleness_max"] for s in steps), default=0),
        "mean_staleness": sum(s["staleness_mean"] for s in steps) / max(len(steps), 1),
        "reward_first": steps[0]["reward_mean"] if steps else None,
        "reward_last": steps[-1]["reward_mean"] if steps else None,
        "n_samples": n_samples, "n_tokens": n_tokens,
        **{f"eval_tool_use_{when}": e.get("tool_use_rate", 0.0)
           for when, e in (("before", before), ("after", after))
           if cfg.rollout.workflow != SINGLE_TURN and e},
    }
