"""The Ray Data pipeline: prompts -> rollout -> reward, streamed into Ray Train.

Prompts come from the prompt stream's read tasks (stream.py), one prompt per block,
so each stage handles one group per task and no stage ever waits to fill a batch: a row held back in a half-full bundle while the
staleness gate waits for training would deadlock the run (docs/stack_facts.md). The rollout
stage is an async actor UDF: each of its concurrent calls asks the driver for a
ticket (waiting while the gate is full), runs the rollout workflow's episode on the
row (`rollout.workflow`, areal_ray/rollout/workflows/base.py) through the rollout Serve
app under the episode deadline (`rollout.episode_timeout_s`), and tells the driver it
finished (`AdmittedEpisodes`). The reward
stage is an autoscaling actor pool (`ActorPoolStrategy(min_size, max_size)`).

Ray Train calls a `PipelineFactory` each time it starts the trainer's worker group,
so a restart after a failure gets a fresh pipeline; the factory opens a new driver
generation, which turns the previous pipeline's gate calls into no-ops. Rows carry
their position in the prompt stream, so prompts consumed before the checkpoint the
trainer resumes from are skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import ray
from ray.data import ActorPoolStrategy
from ray.data.context import DEFAULT_ACTOR_POOL_UTIL_DOWNSCALING_THRESHOLD

from areal_ray.cluster.home import near_node, on_node
from areal_ray.data.deadline import EpisodeDeadline
from areal_ray.data.stream import PromptStream, prompt_dataset
from areal_ray.reward.pool import RewardStage
from areal_ray.reward.sandbox import ENV as SANDBOX_ENV
from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.workflows.base import (
    SINGLE_TURN,
    EpisodeConfig,
    abandoned,
    build_workflow,
    check_episode,
    group_of,
)
from areal_ray.types import Group

logger = logging.getLogger(__name__)
EMPTY = {"ticket": np.array([], dtype=np.int64), "group": np.array([], dtype=object)}
LATE = object()  # what `before_deadline` returns for an episode it abandoned


def _row(batch: dict[str, np.ndarray], i: int) -> dict:
    """Row `i` of a batch as plain Python values (what a workflow gets)."""
    return {k: v[i].item() if isinstance(v[i], np.generic) else v[i] for k, v in batch.items()}


async def before_deadline(coro, timeout_s: float, left_behind: set):
    """`coro`'s result, or LATE once `timeout_s` has passed (0: no deadline). A late
    task is cancelled and left behind in `left_behind` until it ends, never awaited:
    an episode that ignores its cancellation, or blocks in a `finally`, must not hold
    the caller either."""
    if timeout_s <= 0:
        return await coro
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    task.cancel()
    left_behind.add(task)
    task.add_done_callback(_forget(left_behind))
    return LATE


def _forget(left_behind: set):
    def done(task: asyncio.Task) -> None:
        left_behind.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: whatever it ended with is of no use now
    return done


class AdmittedEpisodes:
    """Admission around the rollout workflow, per row: a ticket from the driver's
    staleness gate (waiting while it is full), the workflow's episode through the
    engine client within its deadline from the admission (`deadline`, else a fixed
    `timeout_s`: deadline.py), the driver told the group finished (exactly once,
    however the episode ended), then the ticket, admitted version and stream position
    written into the group. `driver` is the driver actor's handle (anything whose
    `acquire`/`finish` `.remote(...)` is awaitable)."""

    def __init__(self, driver, client, workflow, generation: int = 0, timeout_s: float = 0.0,
                 deadline: EpisodeDeadline | None = None):
        self.driver, self.client, self.workflow = driver, client, workflow
        self.generation = generation
        self.deadline = deadline if deadline is not None else EpisodeDeadline(timeout_s)
        self.abandoned = 0  # episodes past their deadline, in this process
        self.left_behind: set[asyncio.Task] = set()  # those of them still unwinding

    async def __call__(self, row: dict) -> Group | None:
        """The group of `row`, admitted; None when the row is not admitted. A row the
        workflow rejects still holds its ticket, which the trainer waits for in order:
        it is delivered as a group without samples, which the trainer drops as the
        dynamic filter drops a group (its slot freed through the gate's rejected count,
        its position recorded as consumed). An episode past the deadline is abandoned
        and its row rejected the same way (`workflow.abandoned` marks the group)."""
        admitted = await self.driver.acquire.remote(row["pos"], self.generation)
        if admitted is None:  # run closed, an old pipeline, or consumed before resume
            return None
        ticket, version = admitted
        timeout_s, t0 = self.deadline.timeout_s(), time.monotonic()
        try:
            group = await before_deadline(self.workflow.arun_episode(self.client, row),
                                          timeout_s, self.left_behind)
            took = time.monotonic() - t0
        finally:
            await self.driver.finish.remote(self.generation)
        if group is LATE:
            self.abandoned += 1
            logger.warning("the episode of prompt %s (uid %s) passed its deadline, %s: abandoned, "
                           "its row rejected (%d so far)", row["pos"], row.get("uid"),
                           self.deadline.describe(timeout_s), self.abandoned)
            group = abandoned(row, timeout_s)
        else:
            self.deadline.observe(took)
            group = group_of(row, []) if group is None else check_episode(group, self.workflow)
        group.ticket, group.admitted_version, group.pos = ticket, version, row["pos"]
        return group


class RolloutStage:
    """The rollout stage of the pipeline: `AdmittedEpisodes` on the driver actor and
    the rollout Serve app, one group per row of each block."""

    def __init__(self, driver_name: str, namespace: str, app_name: str,
                 deployment_name: str, episode: EpisodeConfig, generation: int = 0,
                 workflow: str = SINGLE_TURN, workflow_kwargs: dict | None = None,
                 episode_timeout_s: float = 0.0, deadline: EpisodeDeadline | None = None):
        # Token ids in and out: the rollout app encodes the prompt and decodes the
        # outputs, so this stage (and Ray Data's coordinator and Ray Train's controller,
        # which unpickle this module) never imports transformers or torch.
        self.episode = AdmittedEpisodes(
            ray.get_actor(driver_name, namespace=namespace),
            EngineClient.for_app(app_name, deployment_name),
            build_workflow(workflow, episode, workflow_kwargs),
            generation, episode_timeout_s, deadline)

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict:
        tickets, groups = [], []
        for i in range(len(batch["prompt"])):
            group = await self.episode(_row(batch, i))
            if group is None:
                continue
            row = group.to_row()
            tickets.append(row["ticket"])
            groups.append(row["group"])
        if not tickets:
            return EMPTY
        return {"ticket": np.array(tickets, dtype=np.int64), "group": np.array(groups, dtype=object)}


def episode_deadline(rollout) -> EpisodeDeadline:
    """The rollout stage's episode deadline from `rollout.*` (deadline.py)."""
    return EpisodeDeadline(rollout.episode_timeout_s, rollout.episode_deadline_factor,
                           rollout.episode_deadline_floor_s, rollout.episode_deadline_warmup)


def build_pipeline(stream: PromptStream, cfg, driver_name: str, namespace: str,
                   app_name: str, deployment_name: str, generation: int = 0,
                   home: str = "") -> ray.data.Dataset:
    """`home`: the job's node, where the reads and the rollout (and teacher) stages run
    (cluster/home.py; "": any node), and which the reward pool prefers."""
    ds = prompt_dataset(stream, driver_name, namespace, generation, home)
    concurrent = cfg.rollout.max_concurrent_rollouts or (cfg.algo.eta + 1) * cfg.algo.batch_groups
    ds = ds.map_batches(
        RolloutStage, batch_size=None, num_cpus=0,
        fn_constructor_kwargs=dict(
            driver_name=driver_name, namespace=namespace,
            app_name=app_name, deployment_name=deployment_name,
            episode=EpisodeConfig.from_config(cfg), generation=generation,
            workflow=cfg.rollout.workflow, workflow_kwargs=dict(cfg.rollout.workflow_kwargs),
            episode_timeout_s=cfg.rollout.episode_timeout_s,
            deadline=episode_deadline(cfg.rollout)),
        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=concurrent,
                                  max_concurrent_calls_per_actor=concurrent),
        # a workflow's python tool runs code in the reward sandbox, in the mode the run
        # chose (reward.sandbox; Ray merges these env vars with the job's)
        runtime_env={"env_vars": {SANDBOX_ENV: cfg.reward.sandbox}}, **on_node(home))
    ds = ds.map_batches(
        RewardStage, batch_size=None, num_cpus=cfg.reward.num_cpus,
        fn_constructor_kwargs=dict(reward=cfg.reward, driver_name=driver_name, namespace=namespace),
        compute=ActorPoolStrategy(min_size=cfg.reward.min_actors, max_size=cfg.reward.max_actors),
        **near_node(home))
    if cfg.algo.distill.enabled:  # the teacher scores each rewarded group (areal_ray/distill/)
        from areal_ray.distill.stage import add_teacher_stage  # it imports this module
        ds = add_teacher_stage(ds, cfg, app_name, home)
    return ds


def configure_data_context(ctx: ray.data.DataContext, cfg) -> None:
    """One line per step instead of Ray Data's progress bars; and the reward pool's
    scale-down. Rewards come in bursts, one step's groups at a time, so by utilization
    the pool shrinks between bursts and grows again at the next: each retire and
    restart costs an actor and its checker process, seconds of CPU on a small machine
    (6 restarts in a 40-step quickstart). Unless `reward.scale_down`, Ray Data only
    grows the pool, up to reward.max_actors."""
    ctx.enable_progress_bars = False
    ctx.autoscaling_config.actor_pool_util_downscaling_threshold = (
        DEFAULT_ACTOR_POOL_UTIL_DOWNSCALING_THRESHOLD if cfg.reward.scale_down else -1.0)


class PipelineFactory:
    """What Ray Train gets as the "train" dataset: builds a fresh pipeline (in a new
    driver generation) each time the trainer's worker group starts."""

    def __init__(self, stream: PromptStream, cfg, driver_name: str,
                 namespace: str, app_name: str, deployment_name: str, home: str = ""):
        self.args = (stream, cfg, driver_name, namespace, app_name, deployment_name)
        self.home = home

    def __call__(self) -> ray.data.Dataset:
        # Called in Ray Train's controller: a dataset takes this process's context.
        configure_data_context(ray.data.DataContext.get_current(), self.args[1])
        driver = ray.get_actor(self.args[2], namespace=self.args[3])
        generation = ray.get(driver.begin_generation.remote())
        return build_pipeline(*self.args, generation=generation, home=self.home)
