"""A user's own rollout workflow and reward checker, as a user would write them in a
module of their own (light imports: the reward checker's process imports this file),
named by dotted path in tests/data/test_pipeline.py."""

from areal_ray.rollout.workflows.base import SingleTurnWorkflow


class EvenRowsOnly(SingleTurnWorkflow):
    """Rejects every odd row, tags the groups it keeps, and tries to set their
    admission fields (the rollout stage owns those)."""

    def __init__(self, config, tag: str):
        super().__init__(config)
        self.tag = tag

    async def arun_episode(self, client, row):
        if row["pos"] % 2:
            return None
        group = await super().arun_episode(client, row)
        group.meta["tag"] = self.tag
        group.ticket, group.admitted_version, group.pos = 999, 999, 999
        return group


class ShortTextChecker:
    """Reward 1 for a text of at most `answer` characters."""

    def check(self, text, answer, opts):
        return float(len(text) <= int(answer)), f"length {len(text)}"
