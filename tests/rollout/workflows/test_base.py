"""Rollout workflows without Ray: the single-turn episode on a real engine, the shape a
workflow class must have (checked before Ray starts), and what an episode may return.
The rollout stage running a workflow chosen by path: tests/data/test_pipeline.py."""

import asyncio

import pytest
import torch

from areal_ray.config import Config, load_config
from areal_ray.plugins import PluginError, check_plugins
from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.engines.base import GenerationRequest
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.workflows.base import (
    SINGLE_TURN,
    EpisodeConfig,
    RolloutWorkflow,
    SingleTurnWorkflow,
    build_workflow,
    check_episode,
    group_of,
)
from areal_ray.types import Group, Sample

ROW = {"uid": "u7", "prompt": "12+3=", "answer": "15", "verifier": "math", "pos": 7}


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class InProcessApp:
    """A stand-in for the rollout Serve app's handle (`handle.<method>.remote`) over a
    real engine and its tokenizer, in this process."""

    def __init__(self, engine: HFEngine):
        self.engine = engine
        self.encode = _Method(self._encode)
        self.decode_batch = _Method(self._decode_batch)
        self.generate_batch = _Method(self._generate_batch)

    async def _encode(self, text):
        return self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _decode_batch(self, ids):
        return self.engine.tokenizer.batch_decode(ids, skip_special_tokens=True)

    async def _generate_batch(self, requests: list[GenerationRequest]):
        results = await asyncio.gather(*[self.engine.generate(r) for r in requests])
        return [r.to_dict() for r in results]


def test_single_turn_episode_is_one_group_of_the_row(random_model_dir):
    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    client = EngineClient(InProcessApp(engine))
    workflow = build_workflow(SINGLE_TURN, EpisodeConfig(group_size=3, max_new_tokens=6,
                                                         temperature=1.0))
    assert isinstance(workflow, SingleTurnWorkflow) and isinstance(workflow, RolloutWorkflow)
    group = asyncio.run(workflow.arun_episode(client, ROW))
    prompt_ids = engine.tokenizer("12+3=", add_special_tokens=False)["input_ids"]
    assert (group.uid, group.prompt, group.answer, group.verifier) == ("u7", "12+3=", "15", "math")
    assert group.ticket == -1 and group.admitted_version == -1  # the rollout stage's to fill
    assert len(group.samples) == 3
    for s in group.samples:
        assert s.prompt_ids == prompt_ids and 1 <= len(s.output_ids) <= 6
        assert len(s.logprobs) == len(s.versions) == len(s.output_ids)
        assert s.text == engine.tokenizer.decode(s.output_ids, skip_special_tokens=True)


class Tagging:
    def __init__(self, config, tag="x"):
        self.config, self.tag = config, tag

    async def arun_episode(self, client, row):
        return None


class Blocking:
    def arun_episode(self, client, row):  # not a coroutine
        return None


def not_a_class(config):
    return Tagging(config)


def test_the_workflow_is_built_with_the_config_and_its_kwargs():
    cfg = EpisodeConfig(2, 8, 0.5)
    w = build_workflow(f"{__name__}.Tagging", cfg, {"tag": "t1"})
    assert w.config is cfg and w.tag == "t1"
    assert EpisodeConfig.from_config(load_config(None, ["rollout.group_size=4"])) == \
        EpisodeConfig(4, 96, 1.0)
    assert EpisodeConfig.from_config(load_config(None, ["run.deterministic=true", "train.seed=7"])) == \
        EpisodeConfig(8, 96, 1.0, seed=7)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.workflow=nowhere.Flow"], "rollout.workflow 'nowhere.Flow': no module named 'nowhere'"),
    (["rollout.workflow=Flow"], "rollout.workflow 'Flow': not a dotted path"),
    ([f"rollout.workflow={__name__}.Missing"], f"module {__name__} has no attribute 'Missing'"),
    ([f"rollout.workflow={__name__}.not_a_class"], "not_a_class is a function, not a class"),
    ([f"rollout.workflow={__name__}.Blocking"], "Blocking.arun_episode must be a coroutine"),
    ([f"rollout.workflow={__name__}.ROW"], "ROW is a dict, not a class"),
    ([f"rollout.workflow={__name__}.Group"], "class Group has no method arun_episode()"),
    (["rollout.workflow_kwargs={tag: 1}"], "unexpected keyword argument 'tag'"),
    ([f"rollout.workflow={__name__}.Tagging", "rollout.workflow_kwargs={colour: 1}"],
     "unexpected keyword argument 'colour'"),
])
def test_a_bad_workflow_fails_before_ray_naming_the_key(overrides, message):
    with pytest.raises(PluginError, match="rollout.workflow") as e:
        check_plugins(load_config(None, overrides))
    assert message in str(e.value)


def test_the_default_and_a_user_workflow_pass_the_check():
    assert Config().rollout.workflow == SINGLE_TURN
    check_plugins(load_config(None, []))
    check_plugins(load_config(None, [f"rollout.workflow={__name__}.Tagging",
                                     "rollout.workflow_kwargs={tag: t2}"]))


def test_an_episode_returns_a_group_with_samples_or_none():
    g = group_of(ROW, [Sample([1], [2], [-0.1], [0], "stop")])
    assert check_episode(g, Tagging(None)) is g
    with pytest.raises(TypeError, match="Tagging.arun_episode returned a Group without samples"):
        check_episode(group_of(ROW, []), Tagging(None))
    with pytest.raises(TypeError, match="returned dict: it must return a Group"):
        check_episode({"samples": []}, Tagging(None))
    assert isinstance(g, Group) and g.pos == -1
