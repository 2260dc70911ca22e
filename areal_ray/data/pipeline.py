"""The Ray Data pipeline: prompts -> rollout -> reward, streamed into Ray Train.

Every prompt is its own block, so each stage handles one group per task and no
stage ever waits to fill a batch: a row held back in a half-full bundle while the
staleness gate waits for training would deadlock the run (STACK_NOTES). The rollout
stage is an async actor UDF: each of its concurrent calls asks the driver for a
ticket (waiting while the gate is full), generates the group through the rollout
Serve app with interruptible requests, and tells the driver it finished. The reward
stage is an autoscaling actor pool (`ActorPoolStrategy(min_size, max_size)`).

Ray Train calls a `PipelineFactory` each time it starts the trainer's worker group,
so a restart after a failure gets a fresh pipeline; the factory opens a new driver
generation, which turns the previous pipeline's gate calls into no-ops. Rows carry
their position in the prompt stream, so prompts consumed before the checkpoint the
trainer resumes from are skipped.
"""

from __future__ import annotations

import numpy as np
import ray
from ray import serve
from ray.data import ActorPoolStrategy
from transformers import AutoTokenizer

from areal_ray.reward.pool import RewardStage
from areal_ray.rollout.workflow import generate_group
from areal_ray.types import Group

EMPTY = {"ticket": np.array([], dtype=np.int64), "group": np.array([], dtype=object)}


class RolloutStage:
    def __init__(self, model_path: str, driver_name: str, namespace: str, app_name: str,
                 deployment_name: str, group_size: int, max_new_tokens: int, temperature: float,
                 generation: int = 0):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.driver = ray.get_actor(driver_name, namespace=namespace)
        self.handle = serve.get_deployment_handle(deployment_name, app_name=app_name)
        self.n, self.max_new_tokens, self.temperature = group_size, max_new_tokens, temperature
        self.generation = generation

    async def _generate(self, input_ids: list[int], max_new_tokens: int, temperature: float) -> dict:
        return await self.handle.generate.remote(input_ids, max_new_tokens, temperature)

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict:
        tickets, groups = [], []
        for i in range(len(batch["prompt"])):
            pos = int(batch["pos"][i])
            admitted = await self.driver.acquire.remote(pos, self.generation)
            if admitted is None:  # run closed, an old pipeline, or consumed before resume
                continue
            ticket, version = admitted
            try:
                prompt = str(batch["prompt"][i])
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                samples = await generate_group(self._generate, ids, self.n,
                                               self.max_new_tokens, self.temperature)
                for s in samples:
                    s.text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            finally:
                await self.driver.finish.remote(self.generation)
            g = Group(ticket=ticket, uid=str(batch["uid"][i]), prompt=prompt,
                      answer=str(batch["answer"][i]), verifier=str(batch["verifier"][i]),
                      admitted_version=version, samples=samples, pos=pos)
            row = g.to_row()
            tickets.append(row["ticket"])
            groups.append(row["group"])
        if not tickets:
            return EMPTY
        return {"ticket": np.array(tickets, dtype=np.int64), "group": np.array(groups, dtype=object)}


def build_pipeline(rows: list[dict], cfg, model_path: str, driver_name: str, namespace: str,
                   app_name: str, deployment_name: str, generation: int = 0) -> ray.data.Dataset:
    keep = ("uid", "prompt", "answer", "verifier")
    ds = ray.data.from_items([{"pos": i, **{k: str(r[k]) for k in keep}} for i, r in enumerate(rows)],
                             override_num_blocks=len(rows))
    concurrent = cfg.rollout.max_concurrent_rollouts or (cfg.algo.eta + 1) * cfg.algo.batch_groups
    ds = ds.map_batches(
        RolloutStage, batch_size=None, num_cpus=0,
        fn_constructor_kwargs=dict(
            model_path=model_path, driver_name=driver_name, namespace=namespace,
            app_name=app_name, deployment_name=deployment_name,
            group_size=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, generation=generation),
        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=concurrent,
                                  max_concurrent_calls_per_actor=concurrent))
    ds = ds.map_batches(
        RewardStage, batch_size=None, num_cpus=cfg.reward.num_cpus,
        fn_constructor_kwargs=dict(
            timeout_s=cfg.reward.timeout_s, code_timeout_s=cfg.reward.code_timeout_s,
            code_opts={"time_limit_s": cfg.reward.code_time_limit_s,
                       "memory_limit_mb": cfg.reward.code_memory_limit_mb},
            driver_name=driver_name, namespace=namespace),
        compute=ActorPoolStrategy(min_size=cfg.reward.min_actors, max_size=cfg.reward.max_actors))
    return ds


class PipelineFactory:
    """What Ray Train gets as the "train" dataset: builds a fresh pipeline (in a new
    driver generation) each time the trainer's worker group starts."""

    def __init__(self, rows: list[dict], cfg, model_path: str, driver_name: str,
                 namespace: str, app_name: str, deployment_name: str):
        self.args = (rows, cfg, model_path, driver_name, namespace, app_name, deployment_name)

    def __call__(self) -> ray.data.Dataset:
        # Called in Ray Train's controller: a dataset takes this process's context, and
        # the job prints one line per step instead of Ray Data's progress bars.
        ray.data.DataContext.get_current().enable_progress_bars = False
        driver = ray.get_actor(self.args[3], namespace=self.args[4])
        generation = ray.get(driver.begin_generation.remote())
        return build_pipeline(*self.args, generation=generation)
