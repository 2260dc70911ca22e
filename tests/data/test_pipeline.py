"""The pipeline: its Ray Data settings (without a cluster); the rollout stage's
admission around an episode (without a cluster: the driver's admission state machine
in this process), where an episode that never returns is abandoned at its deadline and
its row rejected exactly once, tickets in order, as the trainer's step assembly sees
them; and the real pipeline (driver actor, rollout Serve app, Ray Data stages) running
a workflow and a reward checker of a user's module (tests/data/user_plugins.py),
chosen by dotted path in the config: a new task type needs no edit of the pipeline."""

import asyncio
import math
import time
import uuid

import pytest
import ray
from ray import serve
from ray.data import DataContext
from ray.data.context import DEFAULT_ACTOR_POOL_UTIL_DOWNSCALING_THRESHOLD

from areal_ray.cluster.placement import delete_app
from areal_ray.config import Config, load_config
from areal_ray.data.pipeline import AdmittedEpisodes, build_pipeline, configure_data_context
from areal_ray.data.staleness import StalenessGate
from areal_ray.data.stream import rows_stream
from areal_ray.driver import Driver
from areal_ray.driver.admission import WAIT, Admission
from areal_ray.plugins import check_plugins
from areal_ray.rollout.workflows.base import ABANDONED, EpisodeConfig, group_of, is_abandoned
from areal_ray.train.feeder import StepAssembler
from areal_ray.train.loop import has_samples
from areal_ray.types import Group, Sample
from deployments.rollout import DEPLOYMENT_NAME, build_app

PLUGINS = "tests.data.user_plugins"  # a user's module, not this one (it imports torch)


@pytest.mark.parametrize("scale_down, threshold", [
    (False, -1.0),  # utilization never goes below 0: only the end of input retires actors
    (True, DEFAULT_ACTOR_POOL_UTIL_DOWNSCALING_THRESHOLD),
])
def test_reward_pool_scale_down_follows_the_config(scale_down, threshold):
    cfg = Config()
    cfg.reward.scale_down = scale_down
    ctx = DataContext()
    configure_data_context(ctx, cfg)
    assert ctx.autoscaling_config.actor_pool_util_downscaling_threshold == threshold
    assert ctx.enable_progress_bars is False


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class LocalDriver:
    """The driver actor's admission calls (areal_ray/driver/actor.py: `acquire`,
    `finish`, `reject`) on its Admission and StalenessGate, in this process."""

    def __init__(self, eta: int, batch_groups: int):
        self.admission = Admission(StalenessGate(eta, batch_groups))
        self.gate = self.admission.gate
        self.acquire, self.finish = _Method(self._acquire), _Method(self._finish)

    async def _acquire(self, position, generation):
        self.admission.arrive(generation)
        while (got := self.admission.decide(position, generation)) is WAIT:
            await asyncio.sleep(0.001)
        return None if got is None else (got.ticket, got.version)

    async def _finish(self, generation):
        self.admission.finish(generation)


class Sleepy:
    """A workflow whose episode of the row at position p takes `delays[p]` seconds
    (math.inf: it never returns); `stubborn`: it also ignores the first cancellation
    and sleeps on. Other rows get one sample at once."""

    def __init__(self, config, delays: dict, stubborn: bool = False):
        self.delays, self.stubborn = delays, stubborn

    async def arun_episode(self, client, row):
        delay = self.delays.get(row["pos"], 0.0)
        try:
            await asyncio.sleep(1e6 if math.isinf(delay) else delay)
        except asyncio.CancelledError:
            if not self.stubborn:
                raise
            await asyncio.sleep(1e6)
        return group_of(row, [Sample([1], [2], [-0.1], [0], "stop")])


class Delivered:
    """A trainer's shard feeder (train/feeder.py) that received `groups`, then the end."""

    def __init__(self, groups):
        self.items, self.exhausted = list(groups), False

    def poll(self, timeout_s):
        items, self.items, self.exhausted = self.items, [], True
        return items


ROWS = [{"uid": f"u{i}", "prompt": "1+2=", "answer": "3", "verifier": "math", "pos": i}
        for i in range(4)]


@pytest.mark.parametrize("deadline, delays, stubborn, late", [
    (0.3, {1: math.inf}, False, [1]),  # sleeps forever
    (0.3, {1: math.inf, 2: math.inf}, True, [1, 2]),  # and ignores its cancellation
    (0.0, {1: 0.5}, False, []),  # no deadline: slow is fine
    (3.0, {1: 0.5}, False, []),  # within the deadline
])
def test_an_episode_past_its_deadline_is_abandoned_and_its_row_rejected_once(
        deadline, delays, stubborn, late):
    driver = LocalDriver(eta=1, batch_groups=len(ROWS) - len(late))
    episodes = AdmittedEpisodes(driver, None, Sleepy(EpisodeConfig(1, 4, 1.0), delays, stubborn),
                                timeout_s=deadline)

    async def scenario():
        t0 = time.perf_counter()
        groups = await asyncio.gather(*[episodes(row) for row in ROWS])
        return groups, time.perf_counter() - t0
    groups, took = asyncio.run(scenario())
    assert took < max(deadline, 0.5) + 1.0, "nothing waited for the late episode"
    # the stage: every row admitted and finished once; the late ones abandoned
    assert sorted(g.ticket for g in groups) == list(range(len(ROWS)))
    assert (driver.gate.state.started, driver.gate.state.running) == (len(ROWS), 0)
    assert [g.pos for g in groups if is_abandoned(g)] == late and episodes.abandoned == len(late)
    assert all(g.meta[ABANDONED] == deadline and not g.samples for g in groups if is_abandoned(g))
    # the trainer: a late row's ticket is walked in order and rejected like a filtered
    # group, once (the gate's rejected count frees its slot)
    delivered = [Group.from_row(g.to_row()) for g in groups]
    steps = StepAssembler(Delivered(delivered), len(ROWS) - len(late), distributed=False,
                          accept=has_samples, on_reject=driver.admission.reject)
    batch = steps.next_step(0)
    by_ticket = {g.ticket: g.pos for g in groups}
    assert [g.ticket for g in batch.groups] == sorted(g.ticket for g in groups if g.pos not in late)
    assert sorted(batch.rejected) == late and driver.gate.state.rejected == len(late)
    assert sum(is_abandoned(g) for g in delivered) == len(late)
    assert all(by_ticket[g.ticket] == g.pos for g in batch.groups)


def test_a_workflow_and_a_checker_named_by_path_run_in_the_pipeline(ray_cluster, random_model_dir):
    cfg = load_config(None, [
        "rollout.num_cpus=0.5", "rollout.group_size=3", "rollout.max_new_tokens=4",
        "algo.eta=8", "algo.batch_groups=1", "rollout.max_concurrent_rollouts=1",
        f"rollout.workflow={PLUGINS}.EvenRowsOnly", "rollout.workflow_kwargs={tag: kept}",
        f"reward.checkers={{short: {PLUGINS}.ShortTextChecker}}"])
    assert "short" in check_plugins(cfg)
    namespace, tag = ray.get_runtime_context().namespace, uuid.uuid4().hex[:6]
    driver_name, app = f"drv-{tag}", f"rollout-{tag}"
    driver = Driver.options(name=driver_name).remote(
        cfg.algo.eta, cfg.algo.batch_groups, cfg.rollout.max_concurrent_rollouts, 30.0)
    serve.start(proxy_location="Disabled")
    try:
        serve.run(build_app(cfg, random_model_dir, driver_name, namespace), name=app, route_prefix=None)
        rows = [{"uid": f"u{i}", "prompt": "1+2=", "answer": str(i % 5), "verifier": "short"}
                for i in range(8)]
        ds = build_pipeline(rows_stream(rows), cfg, driver_name, namespace, app, DEPLOYMENT_NAME)
        groups = sorted((Group.from_row(r) for r in ds.iter_rows()), key=lambda g: g.ticket)
        gate = ray.get(driver.gate_state.remote())
    finally:
        delete_app(app)
        ray.kill(driver)
    # A rejected row keeps its ticket (the trainer walks tickets in order) and comes
    # as a group without samples, which the trainer drops like a filtered group.
    assert [g.ticket for g in groups] == list(range(8)) and gate["started"] == 8
    assert [g.pos for g in groups] == list(range(8))
    assert [bool(g.samples) for g in groups] == [True, False] * 4
    groups = [g for g in groups if g.samples]
    assert all(g.admitted_version == 0 and g.meta["tag"] == "kept" for g in groups)
    rewards = [(s.reward, s.reward_reason, float(len(s.text) <= int(g.answer)), f"length {len(s.text)}")
               for g in groups for s in g.samples]
    assert len(rewards) == 4 * 3 and all(r[:2] == r[2:] for r in rewards)
    assert [s.reward for s in groups[2].samples] == [1.0] * 3  # answer 4: every text fits
