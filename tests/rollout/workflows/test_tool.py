"""The multi-turn tool workflow on a real engine and the warm-started tool model: tool
calls are read and run, results appended as tokens out of the loss, ids round-trip
exactly (the trainer's teacher-forced logprobs of the model's tokens equal the
engine's), and a weight push that interrupts a later turn leaves every token with the
version that produced it. On a scripted engine: whatever a tool call does (a number
too large to print, a power tower, an exception, a tool that never answers), the
sample gets an error result, the episode goes on, and the event loop keeps running."""

import asyncio

import pytest
import torch

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.rollout.engine_client import EngineClient
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.rollout.workflows.base import EpisodeConfig
from areal_ray.rollout.workflows.tool import ToolWorkflow
from areal_ray.rollout.workflows.tools import Calculator, calculate
from tests.rollout.workflows.test_base import InProcessApp, _Method
from tests.rollout.workflows.test_tools import Raiser, Sleeper, with_ticks

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


class CountingCalculator(Calculator):
    """The calculator, counting its calls (it runs in a tool thread, off the episode's loop)."""

    def __init__(self):
        self.calls = 0

    async def call(self, arguments):
        self.calls += 1
        return await super().call(arguments)


async def push_during_the_turn_after_a_call(engine, state, calc):
    """A weight push as version 1 that lands while the turn after the first tool call is
    generating (once it has produced a few tokens)."""
    while not calc.calls:
        await asyncio.sleep(0.001)
    start = engine.load()["tokens"]
    while engine.load()["running"] == 0 or engine.load()["tokens"] < start + 4:
        await asyncio.sleep(0.001)
    await engine.update_weights(state, version=1, mode="abort")


def test_versions_survive_turns_and_an_interrupted_turn(tools_model):
    torch.manual_seed(1)
    engine = HFEngine(tools_model)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v * 1.02 for k, v in old.items()}
    flow = ToolWorkflow(EpisodeConfig(N, 24, 1.0), tools=["calculator"], max_turns=3,
                        max_total_tokens=64)
    calc = flow.tools["calc"] = CountingCalculator()

    async def scenario():
        push = asyncio.ensure_future(push_during_the_turn_after_a_call(engine, new, calc))
        group = await flow.arun_episode(EngineClient(InProcessApp(engine)), ROW)
        pushed = push.done()
        push.cancel()
        return group, pushed
    group, pushed = asyncio.run(scenario())
    assert pushed and calc.calls
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


class ScriptedApp:
    """The rollout app's handle over a "model" that writes `turns[k]` as its k-th turn,
    one character a token (id = ord), stopping at a stop id as an engine does. A tool
    result ends with a newline (result_format "={}\\n"), so the newlines of the output
    tell the turn, and what follows the last one is what the turn wrote so far."""

    def __init__(self, prompt: str, turns: list[str]):
        self.prompt, self.turns = prompt, turns
        self.encode = _Method(self._encode)
        self.decode_batch = _Method(self._decode_batch)
        self.generate_batch = _Method(self._generate_batch)

    async def _encode(self, text):
        return [ord(c) for c in text]

    async def _decode_batch(self, ids):
        return ["".join(map(chr, x)) for x in ids]

    def _next(self, ids, budget, stop_ids):
        out = "".join(map(chr, ids))[len(self.prompt):]
        turn = out.count("\n")
        rest = self.turns[turn][len(out.rsplit("\n", 1)[-1]):] if turn < len(self.turns) else ""
        text = ""
        for c in rest[:budget]:
            text += c
            if ord(c) in stop_ids:
                break
        at_stop = bool(text) and ord(text[-1]) in stop_ids
        reason = "stop" if at_stop or text == rest else "length"  # the turn's end: EOS
        return {"output_ids": [ord(c) for c in text], "logprobs": [-0.1] * len(text),
                "versions": [0] * len(text), "stop_reason": reason}

    async def _generate_batch(self, requests):
        await asyncio.sleep(0)
        return [self._next(r.input_ids, r.max_new_tokens, set(r.stop_ids)) for r in requests]


# (the model's tool call, the tool to add, the start of the result it gets)
FAULTS = {
    "huge": ("calc((9**64)**64*(9**64)**64)", None, "error: the result would be larger"),
    "tower": ("calc((((9**64)**64)**64)**64)", None, "error: the result would be larger"),
    "inf": ("calc(1e308*10)", None, "error: the result is not a finite number (inf)"),
    "raises": ("raiser(1)", Raiser(RuntimeError("kaput")), "error: raiser failed: RuntimeError: kaput"),
    "hangs": ("sleeper(1)", Sleeper(), "error: sleeper timed out after 0.5 s"),
    "fine": ("calc(4821+3907)", None, "8728"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_tool_call_never_crashes_or_stalls_the_episode(fault):
    call, tool, want = FAULTS[fault]
    turns = [call, "so the answer is 42."]
    flow = ToolWorkflow(EpisodeConfig(3, 40, 1.0), tools=["calculator"], max_turns=3,
                        max_total_tokens=200, tool_timeout_s=0.5)
    if tool is not None:
        flow.tools[tool.name] = tool
    client = EngineClient(ScriptedApp(ROW["prompt"], turns))
    try:
        group, gap = asyncio.run(with_ticks(flow.arun_episode(client, ROW)))
    finally:
        if isinstance(tool, Sleeper):
            tool.release.set()
    assert gap < 0.2, f"the event loop stalled for {gap:.2f} s"
    assert len(group.samples) == 3
    for s in group.samples:
        head, result = s.text[:len(call)], s.text[len(call):].split("\n", 1)[0]
        assert head == call and result.startswith("=" + want)
        assert s.text == f"{call}{result}\n{turns[1]}"  # the episode went on
        assert (s.n_turns, s.tool_calls, s.stop_reason) == (2, 1, "stop")
        assert s.loss_mask == [1] * len(call) + [0] * (len(result) + 1) + [1] * len(turns[1])
