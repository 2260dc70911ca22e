"""The policy-loss registry (`algo.loss.name`): the default is the decoupled PPO call
train_step made before there was a registry, bit for bit, with every `algo.loss` option."""

import dataclasses

import pytest
import torch

from areal_ray.algo import losses
from areal_ray.algo.loss import decoupled_ppo_loss
from areal_ray.algo.losses import LossInputs, policy_loss
from areal_ray.config.algo import LossConfig
from areal_ray.config.choices import PolicyLoss


def batch(seed=0, shape=(3, 9)):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(shape, generator=g).requires_grad_()
    seq_ids = torch.arange(shape[0]).repeat_interleave(shape[1]).view(shape)
    return LossInputs(logprobs=lp, proximal_logprobs=torch.randn(shape, generator=g),
                      behavior_logprobs=torch.randn(shape, generator=g),
                      advantages=torch.randn(shape, generator=g),
                      loss_mask=torch.rand(shape, generator=g) > 0.3, normalizer=31.0,
                      seq_ids=seq_ids, ref_logprobs=torch.randn(shape, generator=g))


OPTIONS = [{}, {"eps_clip_high": 0.28, "dual_clip": 3.0}, {"behav_imp_weight_cap": None},
           {"importance_level": "sequence"}, {"kl_coef": 0.1, "kl_estimator": "k1"}]


@pytest.mark.parametrize("options", OPTIONS, ids=[",".join(o) or "defaults" for o in OPTIONS])
def test_the_default_is_the_old_call_bit_for_bit(options):
    cfg = dataclasses.replace(LossConfig(), **options)
    assert cfg.name == losses.DEFAULT == "decoupled_ppo"
    x = batch()
    loss, stats = policy_loss(cfg.name)(x, cfg)
    # train_step's call before the registry (areal_ray/train/step.py at 5e4501b)
    old, old_stats = decoupled_ppo_loss(
        x.logprobs, x.proximal_logprobs, x.behavior_logprobs, x.advantages, x.loss_mask,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
        behav_imp_weight_cap=cfg.behav_imp_weight_cap, normalizer=x.normalizer,
        level=cfg.importance_level, seq_ids=x.seq_ids, ref_logprobs=x.ref_logprobs,
        kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
    assert torch.equal(loss, old)
    assert stats.keys() == old_stats.keys()
    assert all(torch.equal(stats[k], old_stats[k]) for k in stats)
    (grad,) = torch.autograd.grad(loss, x.logprobs)
    (old_grad,) = torch.autograd.grad(old, x.logprobs)
    assert torch.equal(grad, old_grad)


def test_the_config_offers_exactly_the_registered_losses():
    assert PolicyLoss.values() == tuple(losses.LOSSES)


def test_an_unknown_loss_names_the_choices():
    with pytest.raises(ValueError, match=r"algo.loss.name 'reinforce' is not one of \('decoupled_ppo',"):
        policy_loss("reinforce")


def test_a_registered_name_that_is_not_a_function_is_refused(monkeypatch):
    monkeypatch.setitem(losses.LOSSES, "bogus", "areal_ray.algo.losses:DEFAULT")
    with pytest.raises(TypeError, match="not a function"):
        policy_loss("bogus")
