"""decoupled_ppo_loss against values computed by hand (DESIGN invariant 3)."""

import math

import pytest
import torch

from areal_ray.algo.loss import decoupled_ppo_loss


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def ppo_token(lp, prox, adv, eps_lo, eps_hi):
    r = math.exp(lp - prox)
    return max(-adv * r, -adv * min(max(r, 1 - eps_lo), 1 + eps_hi))


def test_matches_hand_computed_values():
    lp, prox, beh = t(-1.0, -0.5, -2.0, -0.1), t(-1.2, -0.4, -1.0, -0.3), t(-1.5, -0.4, -1.1, -0.3)
    adv, mask = t(1.0, -1.0, 2.0, 0.5), t(1, 1, 1, 0)
    loss, stats = decoupled_ppo_loss(lp, prox, beh, adv, mask, eps_clip=0.2)
    expected = sum(math.exp(prox[i] - beh[i]) * ppo_token(lp[i], prox[i], adv[i], 0.2, 0.2)
                   for i in range(3)) / 3
    assert loss.item() == pytest.approx(float(expected), rel=1e-5)
    assert stats["n_tokens"].item() == 3


def test_equals_standard_ppo_when_proximal_is_behaviour():
    g = torch.Generator().manual_seed(0)
    lp, beh = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    adv, mask = torch.randn(4, 7, generator=g), torch.rand(4, 7, generator=g) > 0.3
    loss, stats = decoupled_ppo_loss(lp, beh, beh, adv, mask, eps_clip=0.2)
    r = torch.exp(lp - beh)
    ppo = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    assert loss.item() == pytest.approx((ppo * mask).sum().item() / mask.sum().item(), rel=1e-5)
    assert stats["behav_weight_mean"].item() == pytest.approx(1.0)


def test_cap_masks_tokens_but_keeps_them_in_the_denominator():
    lp = prox = t(-1.0, -1.0)
    beh = t(-1.0, -4.0)  # second token: w = e^3 ~ 20 > cap
    adv, mask = t(1.0, 1.0), t(1, 1)
    loss, stats = decoupled_ppo_loss(lp, prox, beh, adv, mask, behav_imp_weight_cap=5.0)
    assert loss.item() == pytest.approx(-1.0 / 2)  # only token 0 contributes, divided by 2
    assert stats["capped_frac"].item() == pytest.approx(0.5)
    uncapped, _ = decoupled_ppo_loss(lp, prox, beh, adv, mask)
    assert uncapped.item() == pytest.approx(-(1.0 + math.exp(3.0)) / 2, rel=1e-5)


def test_asymmetric_and_dual_clip():
    lp, prox, adv, mask = t(0.5), t(0.0), t(1.0), t(1)
    loss, _ = decoupled_ppo_loss(lp, prox, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    # negative advantage, huge ratio: standard PPO gives A*r = 3*e^2; dual clip caps at c|A|
    lp2, adv2 = t(2.0), t(-3.0)
    loss2, _ = decoupled_ppo_loss(lp2, prox, prox, adv2, mask)
    assert loss2.item() == pytest.approx(3 * math.exp(2.0), rel=1e-5)
    loss3, _ = decoupled_ppo_loss(lp2, prox, prox, adv2, mask, dual_clip=3.0)
    assert loss3.item() == pytest.approx(9.0)


def test_normalizer_makes_microbatch_losses_sum_to_the_batch_mean():
    g = torch.Generator().manual_seed(1)
    lp, prox, beh = (torch.randn(6, 5, generator=g) for _ in range(3))
    adv, mask = torch.randn(6, 5, generator=g), torch.rand(6, 5, generator=g) > 0.4
    full, _ = decoupled_ppo_loss(lp, prox, beh, adv, mask)
    n = mask.sum()
    parts = sum(decoupled_ppo_loss(lp[s], prox[s], beh[s], adv[s], mask[s], normalizer=n)[0]
                for s in (slice(0, 2), slice(2, 6)))
    assert parts.item() == pytest.approx(full.item(), rel=1e-5)


def test_gradient_direction_raises_logprob_of_positive_advantage():
    lp = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _ = decoupled_ppo_loss(lp, lp.detach(), lp.detach(), t(1.0, -1.0), t(1, 1))
    loss.backward()
    assert lp.grad[0] < 0 < lp.grad[1]


def test_empty_mask_and_bad_shapes():
    loss, _ = decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(0))
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        decoupled_ppo_loss(t(0.0, 1.0), t(0.0), t(0.0), t(1.0), t(1))
    with pytest.raises(ValueError, match="dual_clip"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), dual_clip=0.5)
