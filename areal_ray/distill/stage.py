"""The teacher stage of the Ray Data pipeline: rollout -> reward -> teacher.

`TeacherScoring` sends a group's samples to the teacher app in one call and waits at
most `algo.distill.deadline_s`; whatever happens (an answer, a deadline, a dead replica,
an answer that does not fit) the group comes out marked (advantage.py) and the
counter of late groups grows: a slow or dead teacher costs groups, never a hang.
A call past its deadline is cancelled and left behind, never awaited
(`data.pipeline.before_deadline`), as a late episode is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from areal_ray.data.pipeline import EMPTY, LATE, before_deadline
from areal_ray.distill.advantage import FAILED, OK, check_scores, mark
from areal_ray.distill.advantage import LATE as LATE_STATUS
from areal_ray.types import Group

logger = logging.getLogger(__name__)
TEACHER_DEPLOYMENT = "Teacher"

Score = Callable[[list[tuple[list[int], list[int]]]], Awaitable[list[list[float]]]]


def teacher_app_name(app_name: str) -> str:
    """The teacher's Serve app beside the run's rollout app `app_name`, named from the
    same job tag (cluster/ownership.py), so that a killed job's replicas and the sweep
    remove it as they remove the rollout app."""
    from areal_ray.cluster.ownership import Owned, tag_of_app
    tag = tag_of_app(app_name)
    if tag is None:  # a name no sweep would match: the teacher would outlive a killed job
        raise ValueError(f"the rollout app {app_name!r} carries no job tag (cluster/ownership.py), "
                         "so its teacher app could not be swept with it")
    return Owned(tag).served_app_name("teacher")


class TeacherScoring:
    """One group at a time: `score` gets [(prompt_ids, output_ids)] and answers the
    teacher's logprob of each output token; `late` is algo.distill.late."""

    def __init__(self, score: Score, deadline_s: float, late: str = "reward"):
        self.score, self.deadline_s, self.drop = score, deadline_s, late == "drop"
        self.late = 0  # groups late or failed, in this process
        self.left_behind: set = set()

    async def __call__(self, group: Group) -> Group:
        if not group.samples:  # a rejected row travels on untouched
            return group
        pairs = [(s.prompt_ids, s.output_ids) for s in group.samples]
        t0 = time.monotonic()
        try:
            scores = await before_deadline(self.score(pairs), self.deadline_s, self.left_behind)
        except Exception as e:  # noqa: BLE001 - a dead replica is a late group, not a failed run
            return self._late(group, FAILED, t0, f"the teacher call failed: {type(e).__name__}: {e}"[:300])
        if scores is LATE:
            return self._late(group, LATE_STATUS, t0, f"no answer within algo.distill.deadline_s="
                              f"{self.deadline_s:g}")
        why = check_scores(group, scores)
        if why is not None:
            return self._late(group, FAILED, t0, why)
        return mark(group, OK, time.monotonic() - t0, logprobs=[list(map(float, lp)) for lp in scores])

    def _late(self, group: Group, status: str, t0: float, why: str) -> Group:
        self.late += 1
        logger.warning("teacher %s for prompt %s (ticket %s): %s; the group is %s (%d so far)",
                       status, group.pos, group.ticket, why,
                       "dropped" if self.drop else "trained on its task reward alone", self.late)
        return mark(group, status, time.monotonic() - t0, why, drop=self.drop)


class TeacherStage:
    """The Ray Data actor around `TeacherScoring`, calling the teacher app's
    `score_group` through a Serve handle."""

    def __init__(self, app_name: str, deadline_s: float, late: str):
        from ray import serve
        handle = serve.get_deployment_handle(TEACHER_DEPLOYMENT, app_name=app_name)

        async def score(pairs):
            return await handle.score_group.remote(pairs)
        self.scoring = TeacherScoring(score, deadline_s, late)

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict:
        if len(batch["ticket"]) == 0:
            return EMPTY
        tickets, groups = [], []
        for ticket, blob in zip(batch["ticket"], batch["group"]):
            group = await self.scoring(Group.from_row({"ticket": int(ticket), "group": blob}))
            row = group.to_row()
            tickets.append(row["ticket"])
            groups.append(row["group"])
        return {"ticket": np.array(tickets, dtype=np.int64), "group": np.array(groups, dtype=object)}


def add_teacher_stage(ds, cfg, app_name: str, home: str = ""):
    """`ds` followed by the teacher stage: one async actor taking as many groups at once
    as the rollout stage runs episodes; on node `home` ("": any; cluster/home.py)."""
    from ray.data import ActorPoolStrategy

    from areal_ray.cluster.home import on_node
    d = cfg.algo.distill
    concurrent = cfg.rollout.max_concurrent_rollouts or (cfg.algo.eta + 1) * cfg.algo.batch_groups
    return ds.map_batches(
        TeacherStage, batch_size=None, num_cpus=0,
        fn_constructor_kwargs=dict(app_name=teacher_app_name(app_name), deadline_s=d.deadline_s,
                                   late=str(d.late)),
        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=concurrent,
                                  max_concurrent_calls_per_actor=concurrent),
        **on_node(home))
