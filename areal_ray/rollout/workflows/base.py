"""Rollout workflows: how one dataset row becomes the trajectory group that trains.

A workflow is any class with `async arun_episode(client, row) -> Group | None`
(`RolloutWorkflow`), named by dotted path in `rollout.workflow` and built once per
rollout actor with an `EpisodeConfig` and `rollout.workflow_kwargs`. It generates
through the engine client (`engine_client.py`: token ids in and out, retried on a
lost replica) and returns the group to train, or None to reject the row. A new task
type (several turns, tool calls, another prompt format) is a new workflow; the
pipeline stays as it is. Admission is not the workflow's business: the rollout stage
takes the staleness gate's ticket before the episode and fills in the group's
ticket, admitted version and stream position after it, so no workflow can break the
staleness accounting. Nor can an episode that never returns stall the run: past
`rollout.episode_timeout_s` the stage abandons it and rejects its row (`abandoned`).

`SingleTurnWorkflow` is the default: one prompt, n interruptible samples
(`interruptible.py`), decoded for the reward checker.

Nothing here imports torch or Ray: the rollout actor, and a test, import it cheaply.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from areal_ray.plugins import PluginError, import_class
from areal_ray.rollout.interruptible import generate_group
from areal_ray.rollout.seeds import request_seed
from areal_ray.types import Group, Sample

if TYPE_CHECKING:
    from areal_ray.rollout.engine_client import EngineClient

KEY = "rollout.workflow"
SINGLE_TURN = f"{__name__}.SingleTurnWorkflow"  # the default (config.py's too)
ABANDONED = "abandoned_after_s"  # Group.meta key of a row whose episode passed its deadline


@dataclass(frozen=True)
class EpisodeConfig:
    """What every workflow gets from the run config (`rollout.*`): built by
    `from_config` wherever a run builds one (the rollout stage, evaluation, the
    plugin check), so a setting reaches every workflow the same way."""
    group_size: int  # samples per prompt
    max_new_tokens: int  # generation budget per sample (per turn for multi-turn ones)
    temperature: float
    # The run's seed when requests are seeded (`run.deterministic`): seed a request
    # with `request_seed(seed, row["pos"], sample, call)` (rollout/seeds.py).
    seed: int | None = None

    @classmethod
    def from_config(cls, cfg) -> EpisodeConfig:
        """From the run config (`rollout.*`; `train.seed` when `run.deterministic`)."""
        r = cfg.rollout
        return cls(r.group_size, r.max_new_tokens, r.temperature,
                   cfg.train.seed if cfg.run.deterministic else None)

    def seeder(self, position: int):
        """`seed(sample, call)` for the prompt at `position`, or None when unseeded."""
        if self.seed is None:
            return None
        return functools.partial(request_seed, self.seed, position)


@runtime_checkable
class RolloutWorkflow(Protocol):
    async def arun_episode(self, client: EngineClient, row: dict) -> Group | None:
        """One episode on `row` (`prompt`, `answer`, `verifier`, `uid`, `pos`): the
        group to train (`group_of` starts one), or None to reject the row."""


def group_of(row: dict, samples: list[Sample]) -> Group:
    """The group of `row` with `samples`; ticket, admitted version and position are
    left for the rollout stage to fill in."""
    return Group(ticket=-1, uid=str(row["uid"]), prompt=str(row["prompt"]),
                 answer=str(row["answer"]), verifier=str(row["verifier"]),
                 admitted_version=-1, samples=samples)


def abandoned(row: dict, after_s: float) -> Group:
    """The group of a row whose episode was abandoned after `after_s` seconds: without
    samples, so it travels and is rejected as a row the workflow rejected; marked
    (`ABANDONED`) so it can be counted apart."""
    group = group_of(row, [])
    group.meta[ABANDONED] = after_s
    return group


def is_abandoned(group: Group) -> bool:
    return ABANDONED in group.meta


def check_episode(group: object, workflow: object) -> Group:
    """`group` if it is what an episode may return for training (a Group with
    samples); otherwise a TypeError naming the workflow."""
    if not isinstance(group, Group) or not group.samples:
        what = "a Group without samples" if isinstance(group, Group) else type(group).__name__
        raise TypeError(f"{type(workflow).__name__}.arun_episode returned {what}: it must "
                        "return a Group with samples, or None to reject the row")
    return group


class SingleTurnWorkflow:
    """One prompt, `group_size` samples: encode, generate with interruptible
    resubmission, decode what the reward checker grades."""

    def __init__(self, config: EpisodeConfig):
        self.config = config

    async def arun_episode(self, client: EngineClient, row: dict) -> Group:
        c = self.config
        ids = await client.encode(str(row["prompt"]))
        samples = await generate_group(client.generate_batch, ids, c.group_size,
                                       c.max_new_tokens, c.temperature,
                                       c.seeder(int(row.get("pos", -1))))
        texts = await client.decode_batch([s.output_ids for s in samples])
        for s, text in zip(samples, texts):
            s.text = text
        return group_of(row, samples)


def workflow_class(path: str) -> type:
    """The workflow class at `path`; `PluginError` naming `rollout.workflow` if it
    does not import or has no `async def arun_episode`."""
    return import_class(path, KEY, "arun_episode", coroutine=True)


def check_workflow(path: str, config: EpisodeConfig, kwargs: dict) -> type:
    """`workflow_class`, and its constructor takes (config, **kwargs): checked
    before Ray starts without building one (a constructor may be costly). A class
    with a static `check(config, **kwargs)` gets its kwargs' values checked too."""
    cls = workflow_class(path)
    if not isinstance(kwargs, dict):
        raise PluginError(f"rollout.workflow_kwargs must be a mapping, got {type(kwargs).__name__}")
    try:
        inspect.signature(cls).bind(config, **kwargs)
    except TypeError as e:
        shown = {k: "<redacted>" if k == "api_key" else v for k, v in kwargs.items()}  # a key stays out of logs
        raise PluginError(f"{KEY} {path!r} with rollout.workflow_kwargs {shown}: "
                          f"the constructor takes (config, **kwargs): {e}") from e
    if callable(getattr(cls, "check", None)):
        cls.check(config, **kwargs)
    return cls


def build_workflow(path: str, config: EpisodeConfig, kwargs: dict | None = None) -> RolloutWorkflow:
    kwargs = dict(kwargs or {})
    return check_workflow(path, config, kwargs)(config, **kwargs)
