"""The reward pool on a real Ray Data pipeline: it grows under a burst, shrinks when idle,
and a crashed reward actor loses no sample."""

import os
import signal
import threading
import time

import ray
import ray._private.state as gcs_state  # the GCS actor table; the state API needs the dashboard
from ray.data import ActorPoolStrategy

from areal_ray.config.reward import RewardConfig
from areal_ray.reward.pool import RewardStage
from areal_ray.types import Group, Sample

CLASS = "MapWorker(MapBatches(RewardStage))"


def slow_check(verifier, text, answer, opts=None):
    time.sleep(0.3)
    return 1.0, "checked"


class Pace:
    """Upstream stage, one actor: the first 24 rows pass at once (a burst), the rest
    one every 0.5 s (a quiet period)."""

    def __call__(self, row):
        if row["ticket"] >= 24:
            time.sleep(0.5)
        return row


def group_rows(n):
    return [Group(t, f"u{t}", "p", "1", "math", 0,
                  [Sample([1], [2], [-0.1], [0], "stop", text="\\boxed{1}")]).to_row()
            for t in range(n)]


def reward_pipeline(n, min_size, max_size):
    # A check's 5 s default bound, past which its reward is 0 ("timeout"), is the
    # product's; here a loaded machine (a full suite beside it) must not turn a 0.3 s
    # check into a timeout, which would read as a lost grade.
    reward = RewardConfig(timeout_s=60.0)
    ds = ray.data.from_items(group_rows(n), override_num_blocks=n).map(
        Pace, num_cpus=0.1, compute=ActorPoolStrategy(size=1))
    return ds.map_batches(RewardStage, batch_size=None, num_cpus=0.25,
                          fn_constructor_kwargs={"reward": reward, "check_fn": slow_check},
                          compute=ActorPoolStrategy(min_size=min_size, max_size=max_size))


def alive_reward_actors() -> list[int]:
    """Pids of the reward pool's live actors."""
    return [a["Pid"] for a in gcs_state.actors().values()
            if a["ActorClassName"] == CLASS and a["State"] == "ALIVE"]


def test_pool_scales_up_under_a_burst_and_down_after(ray_cluster):
    sizes, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            sizes.append((time.monotonic(), len(alive_reward_actors())))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    out = reward_pipeline(64, 1, 3).take_all()
    stop.set()
    sampler.join()
    assert sorted(r["ticket"] for r in out) == list(range(64))
    peak_at = max(range(len(sizes)), key=lambda i: sizes[i][1])
    assert sizes[peak_at][1] >= 2, sizes  # grew under the burst
    after_peak = [n for _, n in sizes[peak_at:]]
    assert min(after_peak) < sizes[peak_at][1], sizes  # shrank while inputs trickled in
    assert time.monotonic() - t0 < 120


def test_a_killed_reward_actor_loses_no_sample(ray_cluster):
    result = {}

    def run():
        result["rows"] = reward_pipeline(30, 1, 1).take_all()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while not alive_reward_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # let it work on some rows
    victims = alive_reward_actors()
    assert victims
    os.kill(victims[0], signal.SIGKILL)
    t.join(timeout=180)
    rows = result["rows"]
    assert sorted(r["ticket"] for r in rows) == list(range(30))
    groups = [Group.from_row(r) for r in rows]
    graded = [(g.ticket, s.reward, s.reward_reason) for g in groups for s in g.samples]
    assert all((r, why) == (1.0, "checked") for _, r, why in graded), graded
