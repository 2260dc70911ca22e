"""Per-request seeds: a pure function of (run seed, position, sample, call), distinct
across each coordinate, in the engines' range; and the single-turn workflow sends
them with every request when the run is seeded (and none when it is not)."""

import asyncio

import pytest
import torch

from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.seeds import SEED_BITS, request_seed
from areal_ray.rollout.workflows.base import SINGLE_TURN, EpisodeConfig, build_workflow
from tests.rollout.workflows.test_base import ROW, InProcessApp


def test_request_seed_is_a_function_of_the_request_only():
    assert request_seed(0, 7, 1, 0) == request_seed(0, 7, 1, 0)
    seeds = {request_seed(s, p, i, c) for s in (0, 1) for p in (0, 7) for i in (0, 1) for c in (0, 1)}
    assert len(seeds) == 16
    assert all(0 <= x < 2 ** SEED_BITS for x in seeds)


class SeedRecordingApp(InProcessApp):
    def __init__(self, engine):
        super().__init__(engine)
        self.seen: list = []
        inner = self.generate_batch.fn

        async def record(requests):
            self.seen.append([r.seed for r in requests])
            return await inner(requests)
        self.generate_batch.fn = record


@pytest.mark.parametrize("seed", [None, 5])
def test_single_turn_workflow_seeds_each_sample(random_model_dir, seed):
    torch.manual_seed(0)
    app = SeedRecordingApp(HFEngine(random_model_dir))
    flow = build_workflow(SINGLE_TURN, EpisodeConfig(3, 4, 1.0, seed=seed))
    asyncio.run(flow.arun_episode(EngineClient(app), ROW))
    if seed is None:
        assert app.seen == [[None] * 3]
    else:
        assert app.seen == [[request_seed(5, ROW["pos"], i, 0) for i in range(3)]]
