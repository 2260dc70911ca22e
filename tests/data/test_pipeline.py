"""The pipeline: its Ray Data settings (without a cluster), and the real pipeline
(driver actor, rollout Serve app, Ray Data stages) running a workflow and a reward
checker of a user's module (tests/data/user_plugins.py), chosen by dotted path in
the config: a new task type needs no edit of the pipeline."""

import uuid

import pytest
import ray
from ray import serve
from ray.data import DataContext
from ray.data.context import DEFAULT_ACTOR_POOL_UTIL_DOWNSCALING_THRESHOLD

from areal_ray.config import Config, load_config
from areal_ray.data.pipeline import build_pipeline, configure_data_context
from areal_ray.data.stream import rows_stream
from areal_ray.driver import Driver
from areal_ray.plugins import check_plugins
from areal_ray.types import Group
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
        serve.delete(app)
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
