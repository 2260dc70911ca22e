"""A rollout workflow: `InstructedWorkflow` puts an instruction before every prompt,
rejects rows whose prompt is too long, and samples the group as the default does.

A workflow is any class with `async arun_episode(client, row) -> Group | None`, built
with the `EpisodeConfig` and `rollout.workflow_kwargs` (docs/workflows.md). To use it,
no library file changes; the config names it:
    rollout.workflow=examples.extending.my_workflow.InstructedWorkflow
    rollout.workflow_kwargs={instruction: "Answer in a box. ", max_prompt_chars: 200}
"""

from __future__ import annotations

from areal_ray.rollout.interruptible import generate_group
from areal_ray.rollout.workflows.base import EpisodeConfig, group_of
from areal_ray.types import Group


class InstructedWorkflow:
    def __init__(self, config: EpisodeConfig, instruction: str = "", max_prompt_chars: int = 1000):
        self.config, self.instruction, self.max_prompt_chars = config, instruction, max_prompt_chars

    @staticmethod
    def check(config: EpisodeConfig, instruction: str = "", max_prompt_chars: int = 1000) -> None:
        """Run before Ray starts (`check_plugins`): a bad kwarg fails the job at once."""
        if max_prompt_chars < 1:
            raise ValueError("rollout.workflow_kwargs.max_prompt_chars must be >= 1")

    async def arun_episode(self, client, row: dict) -> Group | None:
        prompt = self.instruction + str(row["prompt"])
        if len(prompt) > self.max_prompt_chars:
            return None  # rejected: the run reads another prompt in its place
        c = self.config
        ids = await client.encode(prompt)
        # Interruptible: a sample a weight push aborts is resubmitted with its tokens so far.
        samples = await generate_group(client.generate_batch, ids, c.group_size,
                                       c.max_new_tokens, c.temperature,
                                       c.seeder(int(row.get("pos", -1))))
        for s, text in zip(samples, await client.decode_batch([s.output_ids for s in samples])):
            s.text = text  # what the reward checker grades
        return group_of(row, samples)
