"""The named choices of the config, as string enums omegaconf validates.

A bad value is refused by omegaconf with the key and the allowed values
("Invalid value 'tgi', expected one of [hf, vllm, sglang]"): members are named by their
values for that reason. Being `str`s, members compare equal to their values and format
as them, so `cfg.rollout.backend == "hf"` and f-strings read as before.

They live in this module, which imports nothing heavy, rather than next to the code
that implements them (`algo/`, `weights`), because those import torch, and the config
is unpickled in processes that never run a tensor op: Ray Train's controller, Ray
Data's coordinator and the job's `--help`. Importing torch there costs seconds of
start-up and ~300 MB per process.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from areal_ray.algo.corrections import CORRECTIONS, OFF
from areal_ray.algo.losses import LOSSES
from areal_ray.rollout.engines.registry import ENGINES


class Choice(StrEnum):
    """A config choice; `values()` are what may be written in a config."""

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


# One member per engine in the registry, which names engines without importing them.
RolloutBackend = Choice("RolloutBackend", {name: name for name in ENGINES})


# One member per policy loss in its registry (torch-free "module:function" names).
PolicyLoss = Choice("PolicyLoss", {name: name for name in LOSSES})


# "off" and one member per mismatch correction in its table (algo/corrections.py).
CorrectionMode = Choice("CorrectionMode", {name: name for name in (OFF, *CORRECTIONS)})


class Batching(Choice):
    continuous = "continuous"
    static = "static"
    invariant = "invariant"  # every request its own cohort: bit-identical whatever else runs


class LoraPush(Choice):
    auto = "auto"
    pause = "pause"
    finish = "finish"


class Router(Choice):
    least_tokens = "least_tokens"
    pow2 = "pow2"


class AdvEstimator(Choice):
    grpo = "grpo"
    dr_grpo = "dr_grpo"
    rloo = "rloo"
    gae = "gae"  # not a group estimator: the critic's GAE (areal_ray/train/critic.py)


class AdvNorm(Choice):
    none = "none"
    batch = "batch"


class ImportanceLevel(Choice):
    token = "token"
    sequence = "sequence"


class ProxLogp(Choice):
    recompute = "recompute"
    loglinear = "loglinear"


class KlEstimator(Choice):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class LrSchedule(Choice):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class EmbeddedTask(Choice):
    arith = "arith"  # chains of small sums, worked or direct (areal_ray/task/arith.py)
    tool_arith = "tool_arith"  # large sums with a calculator tool (areal_ray/task/tool_arith.py)
    chain_arith = "chain_arith"  # long worked chains, long-tailed lengths (areal_ray/task/chains.py)


class WeightPath(Choice):
    auto = "auto"
    collective = "collective"
    shm = "shm"
    object_store = "object_store"
    disk = "disk"


class CollectiveBackend(Choice):
    gloo = "gloo"
    nccl = "nccl"


# A literal, not an enum: the empty choice ("as model.dtype") cannot be a member's name.
MasterDtype = Literal["", "float32", "bfloat16", "float16"]
