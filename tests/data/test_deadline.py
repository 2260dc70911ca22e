"""An episode's deadline follows the run's own episode durations (a multiple of the recent
p99, with a floor), under rollout.episode_timeout_s as the hard ceiling; and the rollout
stage abandons a stuck episode at that bound, not at the ceiling."""

import asyncio

import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.data.deadline import EpisodeDeadline
from areal_ray.data.pipeline import AdmittedEpisodes, episode_deadline
from areal_ray.rollout.workflows.base import ABANDONED, EpisodeConfig, is_abandoned
from tests.data.test_pipeline import LocalDriver, Sleepy


@pytest.mark.parametrize("ceiling, factor, floor, warmup, durations, want", [
    (1800, 5, 120, 3, [], 1800),  # nothing seen: the ceiling
    (1800, 5, 120, 3, [1.0, 1.0], 1800),  # still warming up
    (1800, 5, 120, 3, [1.0, 1.0, 1.0], 120),  # warm: 5 x 1 s is under the floor
    (1800, 5, 10, 3, [1.0, 2.0, 3.0], 15),  # 5 x p99 (3 s)
    (1800, 5, 10, 3, [1.0] * 99 + [3.0], 10),  # p99 of 100 is the 99th: 1 s, so the floor
    (1800, 5, 1, 3, [1.0] * 98 + [3.0, 4.0], 15),  # the 99th of 100 is 3 s
    (100, 5, 10, 3, [60.0] * 5, 100),  # never above the ceiling
    (0, 5, 10, 3, [1.0] * 5, 0),  # a ceiling of 0: no deadline at all
    (1800, 0, 10, 3, [1.0] * 5, 1800),  # factor 0: the ceiling alone
    (1800, 5, 0, 1, [float("nan"), float("inf"), -1.0], 1800),  # nonsense is not a duration
])
def test_the_deadline_follows_recent_durations(ceiling, factor, floor, warmup, durations, want):
    d = EpisodeDeadline(ceiling, factor, floor, warmup)
    for x in durations:
        d.observe(x)
    assert d.timeout_s() == pytest.approx(want)


def test_only_the_recent_window_counts():
    d = EpisodeDeadline(1800, 2, 0, 1, window=10)
    for _ in range(10):
        d.observe(100.0)
    assert d.timeout_s() == 200
    for _ in range(10):
        d.observe(1.0)
    assert d.timeout_s() == 2  # the slow ones are out of the window


def test_the_log_line_names_where_the_deadline_came_from():
    d = EpisodeDeadline(1800, 5, 0.5, 2)
    assert d.describe(d.timeout_s()) == "rollout.episode_timeout_s=1800"
    d.observe(0.2), d.observe(0.2)
    assert d.describe(d.timeout_s()) == ("1 s = max(rollout.episode_deadline_floor_s=0.5, "
                                         "rollout.episode_deadline_factor=5 x recent p99 0.2 s)")


@pytest.mark.parametrize("keys, match", [
    (["rollout.episode_deadline_factor=-1"], "episode_deadline_factor must be >= 0"),
    (["rollout.episode_deadline_factor=0.5"], "would abandon episodes the run counts as normal"),
    (["rollout.episode_deadline_floor_s=-1"], "episode_deadline_floor_s must be >= 0"),
    (["rollout.episode_deadline_warmup=0"], "episode_deadline_warmup must be >= 1"),
])
def test_bad_deadline_keys_are_config_errors(keys, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, keys)


def test_the_stage_gets_the_configured_policy():
    cfg = load_config(None, ["rollout.episode_timeout_s=900", "rollout.episode_deadline_factor=3",
                             "rollout.episode_deadline_floor_s=30", "rollout.episode_deadline_warmup=8"])
    d = episode_deadline(cfg.rollout)
    assert (d.ceiling_s, d.factor, d.floor_s, d.warmup) == (900, 3, 30, 8)


def test_a_stuck_episode_is_abandoned_at_the_runs_own_bound_not_the_ceiling():
    """Eight quick episodes warm the policy up; the ninth never returns. With the
    one-hour ceiling alone this test would hang; it ends at the floor (0.2 s)."""
    rows = [{"uid": f"u{i}", "prompt": "1+2=", "answer": "3", "verifier": "math", "pos": i}
            for i in range(9)]
    driver = LocalDriver(eta=8, batch_groups=1)
    deadline = EpisodeDeadline(3600, factor=5, floor_s=0.2, warmup=8)
    episodes = AdmittedEpisodes(driver, None, Sleepy(EpisodeConfig(1, 4, 1.0), {8: float("inf")}),
                                deadline=deadline)

    async def scenario():
        quick = [await episodes(r) for r in rows[:8]]
        return quick, await episodes(rows[8])
    quick, stuck = asyncio.run(scenario())
    assert not any(is_abandoned(g) for g in quick)
    assert is_abandoned(stuck) and stuck.meta[ABANDONED] == pytest.approx(0.2)
    assert episodes.abandoned == 1
