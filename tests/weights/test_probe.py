"""The load probe (weights/probe.py): a push that changed nothing is an error.

Table-driven checks of `ProbeCheck`; then the real parts: the trainer's forward
(`train/probe.model_probe`) against what a real HFEngine scores after a full push and
after an adapter push (bit-identical for full float32 weights), and a push whose load
is skipped (an HFEngine subclass that drops the tensors, the test-only hook) caught
with the replica, the version and the diff named.
"""

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.train.probe import model_probe
from areal_ray.weights.probe import (
    PROBE_TOKENS,
    ProbeCheck,
    ProbeMismatch,
    probe_atol,
    probe_ids,
    run_probe_atol,
)

IDS = [3, 10, 17, 24]
WANT = [-1.0, -2.0, -0.5]


@pytest.mark.parametrize("vocab", [4, 87, 151_936])
def test_probe_ids_are_fixed_and_inside_the_vocabulary(vocab):
    ids = probe_ids(vocab)
    assert len(ids) == PROBE_TOKENS and ids == probe_ids(vocab)
    assert all(3 <= i < vocab for i in ids)
    if vocab > 100:
        assert len(set(ids)) == PROBE_TOKENS


def test_a_vocabulary_too_small_for_the_probe_is_refused():
    with pytest.raises(ValueError, match="vocabulary of 3 ids is too small"):
        probe_ids(3)


# (replica's probe, atol, expected: max diff or the error it raises)
CHECKS = [
    ((IDS, WANT), 0.0, 0.0),                                       # bit-identical
    ((IDS, [-1.0, -2.0, -0.5 + 1e-6]), 1e-5, 1e-6),                # within tolerance
    ((IDS, [-1.0, -2.1, -0.5]), 1e-3, "replica r does not serve v2: .* up to 0.1 "),
    ((IDS, [-1.0, math.nan, -0.5]), 1e-3, "up to nan"),            # NaN never passes
    ((IDS[:3], WANT[:2]), 1e-3, "scored another probe for v2"),
    (([4, 10, 17, 24], WANT), 1e-3, "scored another probe"),       # other ids, same logprobs
    (None, 1e-3, "acked v2 without a probe"),
]


@pytest.mark.parametrize("probe,atol,expected", CHECKS)
def test_probe_check(probe, atol, expected):
    check = ProbeCheck(atol)
    check.expect(2, IDS, WANT)
    if isinstance(expected, str):
        with pytest.raises(ProbeMismatch, match=expected):
            check.check("r", 2, probe)
    else:
        got = check.check("r", 2, probe)
        assert got.max_diff == pytest.approx(expected, abs=1e-9) and got.version == 2


def test_a_version_the_trainer_did_not_probe_is_not_checked():
    check = ProbeCheck(0.0)
    assert check.check("r", 1, None) is None  # the model on disk, a restore, the final weights
    assert check.summary(1) == {}


def test_the_signal_is_how_far_one_step_moved_the_probe():
    check = ProbeCheck(1e-3)
    check.expect(1, IDS, WANT)
    check.expect(2, IDS, [-1.0, -2.0, -0.25])
    check.check("a", 2, (IDS, [-1.0, -2.0, -0.2502]))
    assert check.summary(2) == {"probe_max_diff": pytest.approx(2e-4), "probe_signal": 0.25}
    assert check.summary(1)["probe_signal"] is None
    # a replica still on v1's weights differs by the signal: caught, and the message says so
    with pytest.raises(ProbeMismatch, match="one step moved them by 0.25"):
        check.check("b", 2, (IDS, WANT))


def test_expectations_of_old_versions_are_let_go():
    check = ProbeCheck(1e-3)
    for v in range(1, 8):
        check.expect(v, IDS, WANT)
    assert sorted(check.expected) == [5, 6, 7]


@pytest.mark.parametrize("overrides,atol", [
    ([], 1e-5),                                               # hf, float32
    (["rollout.backend=vllm"], 1e-3),
    (["weights.dtype=bfloat16"], 5e-2),                       # rounded on the way
    (["model.lora.enabled=true", "weights.path=shm"], 1e-4),  # merged vs unmerged
    (["model.lora.enabled=true", "weights.path=shm", "rollout.backend=vllm"], 1e-3),
    (["weights.probe_atol=0.25"], 0.25),
    (["weights.probe=false"], None),
    (["rollout.backend=sglang"], None),                       # cannot score one yet
])
def test_a_runs_tolerance_follows_its_engine_and_dtypes(overrides, atol):
    assert run_probe_atol(load_config(None, overrides)) == atol


def test_an_engine_without_a_default_tolerance_is_named():
    with pytest.raises(ValueError, match="no probe tolerance for engine 'tgi'"):
        probe_atol("tgi", ("float32",))


def test_a_negative_tolerance_is_a_config_error():
    from areal_ray.config import ConfigError
    with pytest.raises(ConfigError, match="weights.probe_atol must be >= 0 or null"):
        load_config(None, ["weights.probe_atol=-1"])


# ----------------------------------------------------------------- real engines
def perturbed_state(model, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


class SkippedLoadEngine(HFEngine):
    """The test-only hook: a real HFEngine whose load drops the tensors, as a broken
    receiver or a name mapping that matched nothing would."""

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def probe_of(engine) -> tuple[list[int], list[float]]:
    ids = probe_ids(engine.limits.vocab_size)
    return ids, asyncio.run(engine.score(ids))


@pytest.mark.parametrize("engine_cls", [HFEngine, SkippedLoadEngine])
def test_the_probe_passes_an_applied_push_bit_for_bit_and_catches_a_skipped_one(
        random_model_dir, engine_cls):
    trainer = AutoModelForCausalLM.from_pretrained(random_model_dir)
    trainer.train()  # as in the train loop: the probe runs in eval mode and restores this
    engine = engine_cls(random_model_dir)
    check = ProbeCheck(probe_atol("hf", ("float32",)))
    check.expect(0, *model_probe(trainer))
    assert check.check("replica-1", 0, probe_of(engine)).max_diff == 0.0  # same weights
    new = perturbed_state(trainer, seed=1)
    trainer.load_state_dict(new)
    check.expect(1, *model_probe(trainer))
    assert trainer.training
    asyncio.run(engine.update_weights(new, 1))
    assert engine.version == 1  # the ack alone would say "v1 loaded" either way
    if engine_cls is HFEngine:
        assert check.check("replica-1", 1, probe_of(engine)).max_diff == 0.0
    else:
        with pytest.raises(ProbeMismatch, match=r"replica replica-1 does not serve v1: its probe "
                                                r"logprobs differ from the trainer's by up to"):
            check.check("replica-1", 1, probe_of(engine))
