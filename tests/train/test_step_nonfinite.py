"""Non-finite numbers never reach the optimizer (issue 30), on the real train_step.

A sequence with a NaN/inf reward, advantage or behaviour logprob is left out and named:
the weights are exactly those of the same step without it. A loss or gradient norm
that overflows from finite inputs skips the optimizer step: every weight (and, with
AdamW's weight decay, the optimizer's effect) stays bit-identical, and the stats say
which micro-batch or quantity it was."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.train.critic import load_critic
from areal_ray.train.fsdp import full_state_dict, load_sharded_model
from areal_ray.train.loop import flatten_groups
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models, train_step
from tests.algo.test_packing import make_seqs
from tests.train.test_loop import make_groups

NAN, INF = float("nan"), float("inf")


def batch(n=6):
    return [dict(s, ticket=i // 2, sample=i % 2, reward=1.0) for i, s in enumerate(make_seqs(n))]


def models(model_dir, critic=False) -> Models:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    # Weight decay moves every weight at any step, even on zero gradients: an unchanged
    # weight means no optimizer step at all.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    m = Models(model, opt, make_scheduler(opt, 10, 0, "constant"))
    if critic:
        m.critic = load_critic(model_dir)
        m.critic_opt = torch.optim.AdamW(m.critic.parameters(), lr=1e-2, weight_decay=0.1)
    return m


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(model_dir, seqs, overrides=(), m=None, version=0):
    m = m or models(model_dir)
    cfg = load_config(None, ["algo.optim.lr=1e-2", *overrides])
    stats = train_step(m, copy.deepcopy(seqs), cfg, pad_id=0, version=version)
    return m, stats


def set_logprob(value):
    def apply(s):
        s["logprobs"] = [value, *s["logprobs"][1:]]
    return apply


@pytest.mark.parametrize("spoil, named", [
    (lambda s: s.update(advantage=NAN), "advantage nan"),
    (lambda s: s.update(advantage=-INF), "advantage -inf"),
    (lambda s: s.update(reward=NAN), "reward nan"),
    (set_logprob(NAN), "behaviour logprob nan"),
    (set_logprob(-INF), "behaviour logprob -inf"),
], ids=["nan-advantage", "inf-advantage", "nan-reward", "nan-logprob", "inf-logprob"])
def test_a_sequence_with_a_nonfinite_input_is_left_out_and_named(random_model_dir, spoil, named):
    seqs = batch()
    spoil(seqs[3])  # ticket 1 sample 1
    torch.manual_seed(0)
    m, stats = run(random_model_dir, seqs)
    torch.manual_seed(0)
    ref, ref_stats = run(random_model_dir, seqs[:3] + seqs[4:])
    assert identical(weights(m.policy), weights(ref.policy))  # as if it was never there
    assert stats["loss"] == ref_stats["loss"] and math.isfinite(stats["loss"])
    assert stats["nonfinite_samples"] == 1 and stats["skipped_nonfinite"] == 0
    at = " at token 0" if "logprob" in named else ""
    assert stats["nonfinite"] == [f"ticket 1 sample 1: {named}{at}"]


@pytest.mark.parametrize("overrides", [[], ["algo.optim.ppo_minibatches=2"]], ids=["1-step", "2-steps"])
def test_a_batch_of_nonfinite_inputs_leaves_every_weight_unchanged(random_model_dir, overrides):
    seqs = batch()
    for s in seqs:
        s["advantage"] = NAN
    m = models(random_model_dir)
    before = weights(m.policy)
    _, stats = run(random_model_dir, seqs, overrides, m=m)
    assert identical(weights(m.policy), before)
    assert stats["nonfinite_samples"] == len(seqs) and stats["n_microbatches"] == 0
    assert stats["skipped_nonfinite"] == (2 if overrides else 1) and stats["nonfinite_streak"] == 1
    assert math.isnan(stats["loss"])


def huge_advantages(seqs):
    for s in seqs:
        s["advantage"] = 3e38  # finite, but its gradients overflow float32
    return seqs


def huge_behaviour_weights(seqs):
    for s in seqs:  # pi_prox / pi_behav = exp(~95): inf in float32, uncapped
        s["logprobs"] = [-100.0] * len(s["logprobs"])
    return seqs


@pytest.mark.parametrize("make, overrides, named", [
    (huge_advantages, [], "optimizer step skipped: minibatch 0: grad_norm inf"),
    (huge_behaviour_weights, ["algo.loss.behav_imp_weight_cap=null"],
     "optimizer step skipped: minibatch 0 micro-batch 0: loss"),
], ids=["grad-norm", "loss"])
def test_an_overflowing_step_is_skipped_with_the_weights_bit_identical(random_model_dir, make,
                                                                       overrides, named):
    m = models(random_model_dir)
    before = weights(m.policy)
    _, stats = run(random_model_dir, make(batch()), overrides, m=m)
    assert identical(weights(m.policy), before)
    assert all(p.grad is None for p in m.policy.parameters())  # the gradients were dropped
    assert stats["skipped_nonfinite"] == 1 and stats["nonfinite_samples"] == 0
    assert len(stats["nonfinite"]) == 1 and stats["nonfinite"][0].startswith(named)


def test_a_sharded_model_skips_the_step_agreed_over_the_process_group(random_model_dir,
                                                                     one_rank_group):
    """The FSDP path (bf16 compute, fp32 master weights) on a one-rank gloo group."""
    model = load_sharded_model(random_model_dir, "bfloat16", master_dtype="float32")
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    m = Models(model, opt, make_scheduler(opt, 10, 0, "constant"))
    _, stats = run(random_model_dir, huge_advantages(batch()), ["algo.microbatch.max_tokens=64"], m=m)
    assert identical(full_state_dict(model), before)
    assert stats["n_microbatches"] > 1 and stats["skipped_nonfinite"] == 1


def test_the_critic_step_is_skipped_too(random_model_dir):
    """GAE: an outcome reward of 3e38 overflows the value loss and the policy's
    gradients; neither the policy nor the critic moves."""
    seqs = batch()
    for s in seqs:
        s["advantage"] = 3e38  # GAE's "advantage" is the shaped outcome reward
    m = models(random_model_dir, critic=True)
    before, critic_before = weights(m.policy), weights(m.critic)
    _, stats = run(random_model_dir, seqs, ["algo.adv.estimator=gae"], m=m)
    assert identical(weights(m.policy), before) and identical(weights(m.critic), critic_before)
    assert stats["skipped_nonfinite"] == 1 and stats["critic_skipped_nonfinite"] == 1
    assert any(n.startswith("critic step skipped: critic") for n in stats["nonfinite"])


def test_a_run_of_skipped_steps_is_counted_and_reported(random_model_dir, capsys):
    m = models(random_model_dir)
    streaks = []
    for version, seqs in enumerate([huge_advantages(batch()), huge_advantages(batch()), batch()]):
        _, stats = run(random_model_dir, seqs, m=m, version=version)
        streaks.append(stats["nonfinite_streak"])
    assert streaks == [1, 2, 0]
    assert "nonfinite" not in stats and stats["skipped_nonfinite"] == stats["nonfinite_samples"] == 0
    out = capsys.readouterr().out
    assert "version 1: non-finite values kept out of training" in out
    assert "2 batches in a row skipped an optimizer step" in out


def test_finite_inputs_train_as_before(random_model_dir):
    m = models(random_model_dir)
    before = weights(m.policy)
    _, stats = run(random_model_dir, batch(), m=m)
    assert not identical(weights(m.policy), before) and math.isfinite(stats["grad_norm"])
    assert (stats["skipped_nonfinite"], stats["nonfinite_samples"], stats["nonfinite_streak"]) == (0, 0, 0)
    assert "nonfinite" not in stats


@pytest.mark.parametrize("spoil, named", [
    (lambda groups: setattr(groups[0].samples[1], "reward", NAN), "reward nan"),
    (lambda groups: groups[0].samples[1].logprobs.__setitem__(0, NAN), "behaviour logprob nan at token 0"),
], ids=["nan-reward", "nan-logprob"])
def test_flatten_groups_names_the_step_and_sample_and_train_step_leaves_it_out(
        random_model_dir, capsys, spoil, named):
    """From the rollout's groups: a NaN reward refuses its whole group (each advantage
    of a GRPO group depends on it), a NaN logprob only its sample; the other group
    trains exactly as it would alone."""
    engine = HFEngine(random_model_dir)
    groups = make_groups(engine, [[1.0, 0.0], [0.0, 1.0]])
    spoil(groups)
    algo = load_config(None).algo
    seqs = flatten_groups(groups, algo, max_new_tokens=8, trained_version=7)
    assert f"step 7: ticket 0 sample 1 is left out of training: {named}" in capsys.readouterr().out
    torch.manual_seed(0)
    m, stats = run(random_model_dir, seqs)
    kept = [s for s in seqs if s["ticket"] == 1 or (s["sample"] == 0 and "logprob" in named)]
    torch.manual_seed(0)
    ref, _ = run(random_model_dir, kept)
    assert identical(weights(m.policy), weights(ref.policy))
    assert stats["nonfinite_samples"] == len(seqs) - len(kept)
    assert f"ticket 0 sample 1: {named}" in stats["nonfinite"]
