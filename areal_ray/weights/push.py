"""Trainer side of a weight push: every rank runs `WeightPusher.push` after a step.

The pusher decides the path of each push on rank 0 (`weights.path`, or with `auto`
shared memory while every registered replica is on the trainer's node, the collective
broadcast otherwise), tells the other trainer ranks (they must run the same gather),
and hands the push to that path's sender (`areal_ray/weights/senders.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import ray
import torch.distributed as dist

from areal_ray.config import WeightsConfig
from areal_ray.train.probe import model_probe
from areal_ray.weights.payloads import AdapterMeta, WeightPayload
from areal_ray.weights.senders import (  # noqa: F401 - push_stats re-exported
    AUTO_PATHS,
    SenderContext,
    push_stats,
    sender_for,
)


class WeightPusher:
    def __init__(self, cfg: WeightsConfig, driver, rank: int, weights_dir: str, owner: str = "",
                 adapter: AdapterMeta | None = None, probe: bool = False):
        """`adapter`: a LoRA run's meta; every push then carries only the adapter.
        `probe`: before each push, tell the driver the probe logprobs every replica must
        reproduce (weights/probe.py)."""
        self.cfg, self.driver, self.rank, self.probe = cfg, driver, rank, probe
        self.node_id = ray.get_runtime_context().get_node_id()
        ctx = self.ctx = SenderContext(cfg, driver, rank, Path(weights_dir), owner, adapter)
        paths = AUTO_PATHS if cfg.path == "auto" else (cfg.path,)
        self.senders = {p: sender_for(p, ctx) for p in paths}

    def choose_path(self) -> str:
        """Rank 0: `auto` is shm while every registered replica shares this node."""
        if self.cfg.path != "auto":
            return self.cfg.path
        nodes = ray.get(self.driver.replica_nodes.remote())
        return "shm" if nodes <= {self.node_id} else "collective"

    def baseline(self, model) -> None:
        """All ranks, at the start of a fresh run (the replicas serve the model on disk,
        as the trainer holds it): the probe there, where engine and trainer hold the same
        weights (weights/probe.py: the moved rule measures each replica's gap from it)."""
        if not self.probe:
            return
        ids, logprobs = model_probe(model)  # every rank: the forward gathers the shards
        if self.rank == 0:
            ray.get(self.driver.probe_baseline.remote(ids, logprobs))

    def push(self, model, version: int) -> tuple[dict, dict]:
        """All ranks: returns (full weights on rank 0 / {} elsewhere, stats on rank 0).
        Every rank must run the same gather, so rank 0's choice of path is broadcast."""
        t0 = time.perf_counter()
        probe_s = None
        if self.probe:  # every rank: the forward gathers each layer's shards
            ids, logprobs = model_probe(model)
            probe_s = time.perf_counter() - t0
            if self.rank == 0:  # registered before any replica can ack this version
                ray.get(self.driver.expect_probe.remote(version, ids, logprobs))
        sender = self.senders[self._agree(self.choose_path() if self.rank == 0 else "")]
        if self.rank != 0:
            sender.follow(model)
            return {}, {}
        weights, stats = sender.push(model, version, t0)
        return weights, {**stats, "probe_trainer_s": probe_s} if self.probe else stats

    def gather(self, model) -> dict:
        """All ranks: what a push would send (the model, or the adapter), whole on the CPU."""
        return self.ctx.gather(model)

    def object_payload(self, weights: dict) -> WeightPayload:
        """Rank 0: `gather`'s weights in the object store, as a push publishes them."""
        return self.ctx.object_payload(weights)

    @staticmethod
    def _agree(path: str) -> str:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return path
        box = [path]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Release what the senders hold (the driver keeps the final weights itself)."""
        for sender in self.senders.values():
            sender.close()
