"""docs/extending.md's worked examples (examples/extending/) run: an engine built through
the engine registry, a workflow's episode on a real engine, a checker through the reward
registry, a loss through the loss registry and train_step. No Ray cluster."""

import asyncio
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_ray.algo import losses
from areal_ray.config import load_config
from areal_ray.rollout.engines import registry
from areal_ray.rollout.engines.base import GenerationRequest, InferenceEngine

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "extending.md"
EXAMPLES = ("echo_engine.py", "my_workflow.py", "my_reward.py", "my_loss.py")
ENGINE = "examples.extending.echo_engine:EchoEngine"
WORKFLOW = "examples.extending.my_workflow.InstructedWorkflow"
CHECKER = "examples.extending.my_reward.LastLineChecker"
LOSS = "examples.extending.my_loss:reinforce_loss"


def test_the_doc_names_every_example_and_at_most_three_files_per_kind():
    doc = DOC.read_text()
    for name in EXAMPLES:
        assert f"examples/extending/{name}" in doc, name
    touched = re.findall(r"^Files touched \((\d)\):", doc, flags=re.MULTILINE)
    assert len(touched) >= 4 and all(int(n) <= 3 for n in touched), touched
    readme = (REPO / "README.md").read_text()
    assert "docs/extending.md" in readme
    assert len(readme.splitlines()) <= 250  # the rest is in docs/, linked from it


# -- an engine: one InferenceEngine subclass, one line in ENGINES -------------------------

def test_the_example_engine_serves_through_the_registry(monkeypatch):
    monkeypatch.setitem(registry.ENGINES, "echo", ENGINE)
    engine = registry.build_engine("echo", "no-model-needed")
    assert isinstance(engine, InferenceEngine) and type(engine).__name__ == "EchoEngine"

    async def drive():
        r = await engine.generate(GenerationRequest([5, 6, 7], max_new_tokens=5))
        assert (r.output_ids, r.logprobs, r.versions, r.stop_reason) == (
            [5, 6, 7, 5, 6], [0.0] * 5, [0] * 5, "length")
        assert (await engine.generate(GenerationRequest([5, 6, 7], 5, stop_ids=[6]))).stop_reason == "stop"

        # A weight update aborts a long request, which returns its partial output...
        long = asyncio.create_task(engine.generate(GenerationRequest([1], max_new_tokens=10_000)))
        await asyncio.sleep(0.01)
        info = await engine.update_weights({"w": torch.zeros(2)}, version=3)
        part = await long
        assert part.stop_reason == "abort" and 0 < len(part.output_ids) < 10_000
        assert set(part.versions) == {0} and info == {"tensors": 1}
        # ... and the next tokens carry the new version.
        assert engine.get_version() == 3
        assert (await engine.generate(GenerationRequest([1], 2))).versions == [3, 3]

        # pause("wait") lets running requests finish; admission stays closed until resume.
        running = asyncio.create_task(engine.generate(GenerationRequest([2], 50)))
        await asyncio.sleep(0)
        await engine.pause("wait")
        assert (await running).stop_reason == "length"
        held = asyncio.create_task(engine.generate(GenerationRequest([2], 1)))
        await asyncio.sleep(0.01)
        assert not held.done()
        await engine.resume()
        assert (await held).output_ids == [2]
        assert engine.load()["running"] == 0

    asyncio.run(drive())


def _config_after_one_line(table: str, key: str, line: str, override: str) -> str:
    """In a fresh interpreter (the config's choices are read from the tables at import):
    add one line to a registry, then load a config that picks it."""
    module, _, var = table.rpartition(".")
    code = (f"import {module} as t; t.{var}[{key!r}] = {line!r}; "
            "from areal_ray.config import load_config; "
            f"print(load_config(None, [{override!r}]))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_one_registry_line_makes_a_config_choice():
    assert "backend=<RolloutBackend.echo" in _config_after_one_line(
        "areal_ray.rollout.engines.registry.ENGINES", "echo", ENGINE, "rollout.backend=echo")
    assert "name=<PolicyLoss.reinforce" in _config_after_one_line(
        "areal_ray.algo.losses.LOSSES", "reinforce", LOSS, "algo.loss.name=reinforce")


# -- a workflow: one class, named by the config ------------------------------------------

def test_the_example_workflow_runs_an_episode_on_a_real_engine(random_model_dir):
    from areal_ray.plugins import PluginError, check_plugins
    from areal_ray.rollout.engine_client import EngineClient
    from areal_ray.rollout.engines.hf import HFEngine
    from areal_ray.rollout.workflows.base import EpisodeConfig, build_workflow
    from tests.rollout.workflows.test_base import InProcessApp

    kwargs = {"instruction": "Sum: ", "max_prompt_chars": 12}
    cfg = load_config(None, [f"rollout.workflow={WORKFLOW}"])
    cfg.rollout.workflow_kwargs = kwargs
    check_plugins(cfg)  # what the job runs before Ray starts
    cfg.rollout.workflow_kwargs = {"max_prompt_chars": 0}
    with pytest.raises(ValueError, match="max_prompt_chars must be >= 1"):
        check_plugins(cfg)
    cfg.rollout.workflow_kwargs = {"instructions": "typo"}
    with pytest.raises(PluginError, match="rollout.workflow_kwargs"):
        check_plugins(cfg)

    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    client = EngineClient(InProcessApp(engine))
    workflow = build_workflow(WORKFLOW, EpisodeConfig(group_size=2, max_new_tokens=4,
                                                      temperature=1.0), kwargs)
    row = {"uid": "u1", "prompt": "12+3=", "answer": "15", "verifier": "math", "pos": 0}

    async def episodes():
        return (await workflow.arun_episode(client, row),
                await workflow.arun_episode(client, dict(row, prompt="1+2+3+4+5=")))

    group, rejected = asyncio.run(episodes())
    assert rejected is None  # "Sum: 1+2+3+4+5=" is longer than 12 characters
    prompt_ids = engine.tokenizer("Sum: 12+3=", add_special_tokens=False)["input_ids"]
    assert group.uid == "u1" and len(group.samples) == 2
    for s in group.samples:
        assert s.prompt_ids == prompt_ids and 1 <= len(s.output_ids) <= 4
        assert len(s.logprobs) == len(s.versions) == len(s.output_ids)
        assert s.text == engine.tokenizer.decode(s.output_ids, skip_special_tokens=True)


# -- a reward: one checker class, named by the config ------------------------------------

def test_the_example_checker_grades_through_the_reward_registry():
    from areal_ray.reward.registry import CheckerRegistry, check_checkers

    extra = load_config(None, [f"reward.checkers={{last_line: {CHECKER}}}"]).reward.checkers
    assert "last_line" in check_checkers(extra)  # what the job runs before Ray starts
    checkers = CheckerRegistry(extra)
    assert checkers.check("last_line", "let me see\n2+2 is\n 4 \n", "4") == (1.0, "match")
    assert checkers.check("last_line", "4\n5", "4") == (0.0, "mismatch")
    assert checkers.check("last_line", "\n", "4") == (0.0, "empty")
    assert checkers.check("math", "\\boxed{4}", "4")[0] == 1.0  # the built-ins stay


# -- a loss: one function, one line in LOSSES --------------------------------------------

def test_the_example_loss_through_the_registry_and_train_step(random_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from areal_ray.algo.losses import LossInputs
    from areal_ray.train.schedule import make_scheduler
    from areal_ray.train.step import Models, train_step
    from tests.algo.test_packing import make_seqs

    monkeypatch.setitem(losses.LOSSES, "reinforce", LOSS)
    fn = losses.policy_loss("reinforce")
    cfg = load_config(None, ["algo.loss.behav_imp_weight_cap=2.0"])
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    beh = torch.tensor([-1.0, -3.0, -0.5])  # token 1: w = e^1 ~ 2.72, capped at 2
    x = LossInputs(lp, lp.detach(), beh, torch.tensor([1.0, 1.0, -1.0]),
                   torch.tensor([1, 1, 0]), normalizer=4.0)
    loss, stats = fn(x, cfg.algo.loss)
    assert loss.item() == pytest.approx(-(1.0 * -1.0 + 2.0 * -2.0) / 4)
    assert stats["n_tokens"].item() == 2 and stats["behav_weight_mean"].item() == pytest.approx(1.5)

    cfg.algo.loss.name = "reinforce"  # the choice the one LOSSES line adds
    seqs = [dict(s, ticket=0) for s in make_seqs(4)]
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=1e-1)
    out = train_step(Models(model, opt, make_scheduler(opt, 10, 0, "constant")), seqs, cfg, 0, 0)
    assert out["skipped_nonfinite"] == 0 and 0 < out["behav_weight_mean"] <= 2.0  # capped
    assert out["clip_frac"] != out["clip_frac"]  # NaN: this loss does not clip
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
