"""The multi-turn tool workflow on a real engine and the warm-started tool model: tool
calls are read and run, results appended as tokens out of the loss, ids round-trip
exactly (the trainer's teacher-forced logprobs of the model's tokens equal the
engine's), and a weight push that interrupts a later turn leaves every token with the
version that produced it."""

import asyncio

import pytest
import torch

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.hf_engine import HFEngine
from areal_ray.rollout.tool_workflow import ToolWorkflow
from areal_ray.rollout.tools import Calculator, calculate
from areal_ray.rollout.workflow import EpisodeConfig
from tests.rollout.test_workflow import InProcessApp

ROW = {"uid": "t1", "prompt": "4821+3907=", "answer": "8728", "verifier": "math", "pos": 3}
N = 16


def teacher_forced(model, s, pad_id):
    b = pad_batch([dict(prompt_ids=s.prompt_ids, output_ids=s.output_ids, logprobs=s.logprobs,
                        versions=s.versions, loss_mask=s.loss_mask, advantage=0.0)], pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, b["input_ids"], b["attention_mask"], 1.0)[0]
    p = len(s.prompt_ids)
    return lp[p - 1:p - 1 + len(s.output_ids)]  # one per output token


def spans(mask):
    """[(start, end, is_model)] runs of the loss mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, bool(mask[start])))
            start = i
    return out


def run_episode(engine, workflow):
    return asyncio.run(workflow.arun_episode(EngineClient(InProcessApp(engine)), ROW))


def test_tool_calls_run_and_their_results_are_tokens_out_of_the_loss(tools_model):
    torch.manual_seed(0)
    engine = HFEngine(tools_model)
    flow = ToolWorkflow(EpisodeConfig(N, 24, 1.0), tools=["calculator"], max_turns=3,
                        max_total_tokens=64)
    group = run_episode(engine, flow)
    tok = engine.tokenizer
    called = [s for s in group.samples if s.tool_calls]
    assert called, "the warm start calls the tool in about half of its samples at T=1"
    for s in group.samples:
        assert len(s.output_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask) <= 64
        assert s.text == tok.decode(s.output_ids, skip_special_tokens=True)
        for start, end, is_model in spans(s.loss_mask):
            if not is_model:  # a tool's result: exactly the calculator's answer, encoded once
                text = tok.decode(s.output_ids[start:end])
                call = tok.decode(s.output_ids[:start]).rsplit("calc(", 1)[1][:-1]
                assert text == "=" + calculate(call) + "\n"
                assert s.logprobs[start:end] == [0.0] * (end - start)
                assert s.versions[start:end] == [-1] * (end - start)
        assert sum(not m for m in s.loss_mask) > 0 or s.tool_calls == 0
        assert s.n_turns == s.tool_calls + 1
        # the ids the trainer scores are those the engine generated from: the model's
        # own tokens get the engine's logprobs back under teacher forcing
        tf = teacher_forced(engine.model, s, engine.pad_id)
        model_pos = [i for i, m in enumerate(s.loss_mask) if m]
        assert torch.allclose(tf[model_pos], torch.tensor(s.logprobs)[model_pos], atol=1e-4)


class PushingCalculator(Calculator):
    """The calculator, which also starts a weight push as version 1 that lands while the
    next turn is generating (once it has produced a few tokens)."""

    def __init__(self, engine, state):
        self.engine, self.state, self.task = engine, state, None

    async def push_when_generating(self):
        start = self.engine.load()["tokens"]
        while self.engine.load()["running"] == 0 or self.engine.load()["tokens"] < start + 4:
            await asyncio.sleep(0.001)
        await self.engine.update_weights(self.state, version=1, mode="abort")

    async def call(self, arguments):
        if self.task is None:
            self.task = asyncio.ensure_future(self.push_when_generating())
        return await super().call(arguments)


def test_versions_survive_turns_and_an_interrupted_turn(tools_model):
    torch.manual_seed(1)
    engine = HFEngine(tools_model)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v * 1.02 for k, v in old.items()}
    flow = ToolWorkflow(EpisodeConfig(N, 24, 1.0), tools=["calculator"], max_turns=3,
                        max_total_tokens=64)
    pusher = flow.tools["calc"] = PushingCalculator(engine, new)
    group = run_episode(engine, flow)
    assert pusher.task is not None and pusher.task.done()
    assert engine.get_version() == 1
    interrupted = [s for s in group.samples if 0 in s.versions and 1 in s.versions]
    assert interrupted, "some sample generated on both sides of the push"
    for s in group.samples:
        model_versions = [v for v, m in zip(s.versions, s.loss_mask) if m]
        assert model_versions == sorted(model_versions)  # never back to the old weights
        assert s.min_version == min(model_versions) and s.staleness(1) == 1 - s.min_version
        tf_new = teacher_forced(engine.model, s, engine.pad_id)
        newer = [i for i, v in enumerate(s.versions) if v == 1]
        assert torch.allclose(tf_new[newer], torch.tensor(s.logprobs)[newer], atol=1e-4)
    engine.model.load_state_dict(old)
    for s in interrupted:
        tf_old = teacher_forced(engine.model, s, engine.pad_id)
        older = [i for i, v in enumerate(s.versions) if v == 0]
        assert torch.allclose(tf_old[older], torch.tensor(s.logprobs)[older], atol=1e-4)
