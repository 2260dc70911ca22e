"""decoupled_ppo_loss against values computed by hand (invariant 3, docs/architecture.md)."""

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


# --- GSPO (level="sequence") -------------------------------------------------------
# Packed layout: positions 0 and 3 are padding (seq_id -1, garbage values).
# seq 0 = positions 1, 2: log-ratios 0.2, -0.1 -> mean m = 0.05; advantages 1, 3 -> 2.
# seq 1 = position 4: log-ratio 0.5, advantage -1.
GS_LP = t(-9.0, -0.8, -1.1, 7.0, -0.5)
GS_PROX = t(0.0, -1.0, -1.0, 0.0, -1.0)
GS_ADV = t(9.0, 1.0, 3.0, 9.0, -1.0)
GS_MASK = t(0, 1, 1, 0, 1)
GS_IDS = torch.tensor([-1, 0, 0, -1, 1])


def test_gspo_sequence_ratio_and_advantage_by_hand():
    beh = GS_PROX.clone()
    beh[1] = -1.0 - math.log(2.0)  # token 1: behaviour weight w = 2, the others 1
    lp = GS_LP.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(lp, GS_PROX, beh, GS_ADV, GS_MASK,
                                     level="sequence", seq_ids=GS_IDS)
    # seq 0: ratio e^0.05 inside [0.8, 1.2], pg = -2 e^0.05 per token, times w (2, 1);
    # seq 1: ratio e^0.5, A = -1: max(e^0.5, 1.2) = e^0.5 (unclipped branch).
    m = 0.05
    assert loss.item() == pytest.approx((-6 * math.exp(m) + math.exp(0.5)) / 3, rel=1e-5)
    loss.backward()
    # gradient goes through the sequence mean: d/dlp_j of -6 e^m / 3 = -2 e^m * (1/2),
    # equal for both tokens of seq 0 although their weights differ.
    expected = [0.0, -math.exp(m), -math.exp(m), 0.0, math.exp(0.5) / 3]
    assert lp.grad.tolist() == pytest.approx(expected, rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(0.0)  # seq 1 takes the unclipped branch


def test_gspo_clips_the_sequence_ratio():
    adv = t(9.0, 1.0, 3.0, 9.0, 1.0)  # seq 1 now has A = +1: e^0.5 is clipped to 1.2
    loss, stats = decoupled_ppo_loss(GS_LP, GS_PROX, GS_PROX, adv, GS_MASK,
                                     level="sequence", seq_ids=GS_IDS)
    assert loss.item() == pytest.approx((-4 * math.exp(0.05) - 1.2) / 3, rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)


def test_gspo_with_one_token_sequences_is_token_level():
    g = torch.Generator().manual_seed(2)
    lp, prox, beh, adv = (torch.randn(3, 4, generator=g) for _ in range(4))
    mask = torch.rand(3, 4, generator=g) > 0.3
    ids = torch.arange(12).reshape(3, 4)
    tok, _ = decoupled_ppo_loss(lp, prox, beh, adv, mask)
    seq, _ = decoupled_ppo_loss(lp, prox, beh, adv, mask, level="sequence", seq_ids=ids)
    assert seq.item() == pytest.approx(tok.item(), rel=1e-5)


def test_gspo_argument_errors():
    with pytest.raises(ValueError, match="level"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), level="group")
    with pytest.raises(ValueError, match="seq_ids"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), level="sequence")
    with pytest.raises(ValueError, match="negative seq_id"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), level="sequence",
                           seq_ids=torch.tensor([-1]))


# --- KL penalty to a reference model --------------------------------------------------

def test_kl_penalty_by_hand_and_not_capped():
    # A = 0, so the policy term is 0 and the loss is the KL term alone.
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    prox, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    beh = t(-1.0, -5.0)  # token 1: w = e^3 > cap 5, masked from the policy term only
    loss, stats = decoupled_ppo_loss(lp, prox, beh, t(0.0, 0.0), t(1, 1),
                                     behav_imp_weight_cap=5.0, ref_logprobs=ref, kl_coef=0.1)
    # k3 with x = ref - lp = (-0.5, 1): e^x - x - 1 = (0.106531, 0.718282), mean 0.412406
    k3 = [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]
    assert stats["kl_ref"].item() == pytest.approx(sum(k3) / 2, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-5)
    assert stats["capped_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # d k3 / d lp = 1 - e^x, times kl_coef / n_tokens = 0.05
    assert lp.grad.tolist() == pytest.approx(
        [0.05 * (1 - math.exp(-0.5)), 0.05 * (1 - math.exp(1.0))], rel=1e-5)


def test_kl_uses_the_shared_normalizer_and_estimator():
    lp, ref = t(-1.0, -2.0, 0.0), t(-1.5, -1.0, 5.0)  # token 2 is masked out
    loss, stats = decoupled_ppo_loss(lp, lp, lp, t(0.0, 0.0, 0.0), t(1, 1, 0), normalizer=4,
                                     ref_logprobs=ref, kl_coef=1.0, kl_estimator="k1")
    assert loss.item() == pytest.approx((0.5 - 1.0) / 4)  # k1 = lp - ref = (0.5, -1)
    assert stats["kl_ref"].item() == pytest.approx(-0.25)
    _, no_ref = decoupled_ppo_loss(lp, lp, lp, t(0.0, 0.0, 0.0), t(1, 1, 0))
    assert no_ref["kl_ref"].item() == 0.0


def test_kl_argument_errors():
    with pytest.raises(ValueError, match="ref_logprobs"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), kl_coef=0.1)
    with pytest.raises(ValueError, match="estimator"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), ref_logprobs=t(0.0),
                           kl_coef=0.1, kl_estimator="k4")
    with pytest.raises(ValueError, match="shapes differ"):
        decoupled_ppo_loss(t(0.0), t(0.0), t(0.0), t(1.0), t(1), ref_logprobs=t(0.0, 1.0),
                           kl_coef=0.1)
