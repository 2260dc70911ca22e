"""The pipeline's Ray Data settings, without a cluster (the e2e tests run it whole)."""

import pytest
from ray.data import DataContext
from ray.data.context import DEFAULT_ACTOR_POOL_UTIL_DOWNSCALING_THRESHOLD

from areal_ray.config import Config
from areal_ray.data.pipeline import configure_data_context


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
