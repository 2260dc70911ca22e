"""Mismatch corrections (algo/corrections.py, algo/is_correction.py) and CISPO against
hand-computed cases; the default objective bit-identical to the one before corrections."""

import math

import pytest
import torch

from areal_ray.algo.corrections import CORRECTIONS
from areal_ray.algo.is_correction import behaviour_correction, mismatch_sums
from areal_ray.algo.loss import cispo_loss, decoupled_ppo_loss, ppo_policy_loss
from areal_ray.algo.losses import LOSSES, LossInputs
from areal_ray.config import ConfigError, load_config

# Two sequences packed in one row: seq 0 = tokens 0..2 with w = 3, 0.4, 1 (product 1.2,
# geometric mean 1.2 ** (1/3) = 1.063); seq 1 = tokens 3..4 with w = 1.5, 1.2 (product
# 1.8, geometric mean 1.342); token 5 is padding (its w = e^7 must not matter).
W = [3.0, 0.4, 1.0, 1.5, 1.2, math.exp(7.0)]
MASK = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool)
SEQ = torch.tensor([0, 0, 0, 1, 1, -1])
LOG_W = torch.log(torch.tensor(W))
T, F = True, False

# (mode, keyword overrides, weights on tokens 0..4, kept tokens, truncated frac, masked frac)
CASES = [
    ("token_tis", {}, [2.0, 0.4, 1.0, 1.5, 1.2], [T, T, T, T, T], 1 / 5, 0.0),
    ("token_tis", {"is_threshold": 1.3}, [1.3, 0.4, 1.0, 1.3, 1.2], [T, T, T, T, T], 2 / 5, 0.0),
    ("seq_tis", {}, [1.2, 1.2, 1.2, 1.8, 1.8], [T, T, T, T, T], 0.0, 0.0),
    ("seq_tis", {"is_threshold": 1.5}, [1.2, 1.2, 1.2, 1.5, 1.5], [T, T, T, T, T], 2 / 5, 0.0),
    # band [1/2, 2]: 3 and 0.4 fall out; the kept weights are not truncated
    ("token_mis", {}, [3.0, 0.4, 1.0, 1.5, 1.2], [F, F, T, T, T], 0.0, 2 / 5),
    ("token_mis", {"rs_threshold": 4.0, "rs_threshold_lower": 0.3}, [3.0, 0.4, 1.0, 1.5, 1.2],
     [T, T, T, T, T], 0.0, 0.0),
    ("seq_mis", {}, [1.2, 1.2, 1.2, 1.8, 1.8], [T, T, T, T, T], 0.0, 0.0),
    # band [1/1.5, 1.5]: sequence 1 (product 1.8) falls out whole
    ("seq_mis", {"rs_threshold": 1.5}, [1.2, 1.2, 1.2, 1.8, 1.8], [T, T, T, F, F], 0.0, 2 / 5),
    # default band [1/1.001, 1.001]: both geometric means are outside it
    ("geo_mis", {}, [2.0, 0.4, 1.0, 1.5, 1.2], [F, F, F, F, F], 1 / 5, 1.0),
    ("geo_mis", {"rs_threshold": 1.1}, [2.0, 0.4, 1.0, 1.5, 1.2], [T, T, T, F, F], 1 / 5, 2 / 5),
    # IcePop's band [0.5, 5]: only 0.4 is out; no weight
    ("icepop", {}, [1.0, 1.0, 1.0, 1.0, 1.0], [T, F, T, T, T], 0.0, 1 / 5),
    ("icepop", {"rs_threshold_lower": 0.3, "rs_threshold": 2.0}, [1.0] * 5, [F, T, T, T, T], 0.0, 1 / 5),
]


def test_every_mode_in_the_table_is_covered():
    assert {c[0] for c in CASES} == set(CORRECTIONS)


@pytest.mark.parametrize("mode,kw,weight,keep,truncated,masked", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_weight_and_mask_match_hand_computed_values(mode, kw, weight, keep, truncated, masked):
    w, k, stats = behaviour_correction(LOG_W, MASK, SEQ, mode, **kw)
    torch.testing.assert_close(w, torch.tensor([*weight, 0.0]))
    assert k.tolist() == [*keep, False]
    assert stats["correction_truncated_frac"].item() == pytest.approx(truncated)
    assert stats["correction_masked_frac"].item() == pytest.approx(masked)


@pytest.mark.parametrize("mode,kw,weight,keep,truncated,masked", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_loss_applies_the_weight_and_mask_with_an_unchanged_denominator(
        mode, kw, weight, keep, truncated, masked):
    """pi_theta == pi_prox: the PPO term is -A per token, so the loss is
    -sum(kept weight * A) / 5 (masked tokens still count in the 5)."""
    behav = torch.zeros(6)
    prox = LOG_W.clone()  # log pi_prox - log pi_behav = log w
    adv = torch.tensor([1.0, 2.0, 1.0, -1.0, 1.0, 9.0])
    corr = {"mode": mode, "is_threshold": kw.get("is_threshold", 2.0),
            "rs_threshold": kw.get("rs_threshold"), "rs_threshold_lower": kw.get("rs_threshold_lower")}
    loss, stats = decoupled_ppo_loss(prox.clone(), prox, behav, adv, MASK, seq_ids=SEQ,
                                     correction=corr)
    expected = -sum(wt * a for wt, a, kp in zip(weight, adv.tolist(), keep) if kp) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["correction_masked_frac"].item() == pytest.approx(masked)


def test_sequence_weights_are_bounded_before_exp():
    """A sequence of 30 tokens with w = e^2 each has product e^60: bounded to e^20."""
    log_w = torch.full((30,), 2.0)
    w, _, _ = behaviour_correction(log_w, torch.ones(30, dtype=torch.bool),
                                   torch.zeros(30, dtype=torch.long), "seq_mis", rs_threshold=1e9,
                                   rs_threshold_lower=1e-9)
    assert torch.isfinite(w).all() and w[0].item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_sequence_modes_need_seq_ids():
    with pytest.raises(ValueError, match="needs seq_ids"):
        behaviour_correction(LOG_W, MASK, None, "seq_tis")


def test_corrections_compose_with_gspo():
    """GSPO's ratio is per sequence; the correction's weight and mask still act per
    token: with pi_theta == pi_prox both objectives reduce to -sum(kept w * A) / n."""
    behav, prox = torch.zeros(6), LOG_W.clone()
    adv = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 0.0])  # constant per sequence
    corr = {"mode": "token_mis", "is_threshold": 2.0, "rs_threshold": None, "rs_threshold_lower": None}
    tok, _ = decoupled_ppo_loss(prox.clone(), prox, behav, adv, MASK, seq_ids=SEQ, correction=corr)
    seq, _ = decoupled_ppo_loss(prox.clone(), prox, behav, adv, MASK, seq_ids=SEQ, correction=corr,
                                level="sequence")
    assert seq.item() == pytest.approx(tok.item()) == pytest.approx(-(1.0 + 1.5 * 2 + 1.2 * 2) / 5)


# --- the default objective is unchanged -------------------------------------------------

def frozen_default_loss(logprobs, proximal, behavior, advantages, loss_mask, cap):
    """The token-level decoupled PPO loss as it was before corrections existed, op for op."""
    mask = loss_mask.bool()
    denom = mask.float().sum().clamp(min=1.0)
    log_ratio = torch.where(mask, logprobs.float() - proximal.float(), 0.0)
    adv = torch.where(mask, advantages.float(), 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    behav_log_w = torch.where(mask, proximal.float() - behavior.float(), 0.0)
    behav_w = torch.exp(behav_log_w).detach()
    keep = mask & (behav_w <= cap)
    return torch.where(keep, pg * behav_w, 0.0).sum() / denom


def test_without_a_correction_the_loss_and_gradients_are_bit_identical():
    g = torch.Generator().manual_seed(3)
    lp0 = -torch.rand(64, generator=g) * 3
    prox = lp0 + 0.3 * torch.randn(64, generator=g)
    behav = prox + 1.0 * torch.randn(64, generator=g)  # some weights above the cap of 5
    adv = torch.randn(64, generator=g)
    mask = torch.rand(64, generator=g) > 0.2
    cfg = load_config(None, []).algo.loss
    assert cfg.correction.mode == "off"
    lp_a, lp_b = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    ref = frozen_default_loss(lp_a, prox, behav, adv, mask, cfg.behav_imp_weight_cap)
    got, stats = ppo_policy_loss(LossInputs(lp_b, prox, behav, adv, mask, normalizer=None,
                                            seq_ids=torch.zeros(64, dtype=torch.long)), cfg)
    assert stats["capped_frac"].item() > 0  # the cap did act on this batch
    assert torch.equal(got, ref)
    ref.backward()
    got.backward()
    assert torch.equal(lp_a.grad, lp_b.grad)


# --- CISPO ---------------------------------------------------------------------------------

def test_cispo_matches_hand_computed_loss_and_gradient():
    """r = 2, 0.5, 8 clipped to [0.8, 6] -> 2, 0.8, 6; loss = -sum(A * clip(r) * logp) / 3,
    so d loss / d logp = -A * clip(r) / 3: the clipped tokens keep a gradient."""
    cfg = load_config(None, ["algo.loss.name=cispo", "algo.loss.cispo_eps_low=0.2"]).algo.loss
    prox = torch.tensor([-1.0, -1.0, -3.0])
    lp = (prox + torch.log(torch.tensor([2.0, 0.5, 8.0]))).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, stats = cispo_loss(LossInputs(lp, prox, prox.clone(), adv, mask, normalizer=3.0), cfg)
    clipped = [2.0, 0.8, 6.0]
    expected = -sum(a * c * x for a, c, x in zip(adv.tolist(), clipped, lp.tolist())) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-2.0, -0.8, -6.0]) * adv / 3)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)


def test_cispo_applies_the_correction_like_the_decoupled_loss():
    cfg = load_config(None, ["algo.loss.name=cispo", "algo.loss.correction.mode=icepop"]).algo.loss
    behav = torch.zeros(6)
    lp = LOG_W.clone().requires_grad_()
    loss, stats = cispo_loss(LossInputs(lp, LOG_W.clone(), behav, torch.ones(6), MASK,
                                        normalizer=5.0, seq_ids=SEQ), cfg)
    # r = 1 everywhere; icepop drops token 1 (w = 0.4) and weights the rest 1
    expected = -sum(x for i, x in enumerate(LOG_W.tolist()[:5]) if i != 1) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["correction_masked_frac"].item() == pytest.approx(1 / 5)


def test_cispo_is_registered():
    assert "cispo" in LOSSES


# --- the config ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["algo.loss.correction.mode=token_tis", "algo.loss.decoupled=false"], "needs algo.loss.decoupled=true"),
    (["algo.loss.name=cispo", "algo.loss.importance_level=sequence"], "cispo is a token-level"),
    (["algo.loss.name=cispo", "algo.loss.dual_clip=3"], "cispo has no dual clip"),
    (["algo.loss.correction.mode=token_mis", "algo.loss.correction.rs_threshold=0.5",
      "algo.loss.correction.rs_threshold_lower=0.9"], "band"),
    (["algo.loss.entropy_coef=-0.1"], "entropy_coef"),
    (["algo.loss.correction.mode=tis"], "tis"),
])
def test_combinations_that_make_no_sense_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("mode", sorted(CORRECTIONS))
@pytest.mark.parametrize("extra", [[], ["algo.loss.importance_level=sequence"], ["algo.loss.name=cispo"]])
def test_every_correction_is_selectable(mode, extra):
    cfg = load_config(None, [f"algo.loss.correction.mode={mode}", *extra])
    assert cfg.algo.loss.correction.mode == mode


# --- mismatch metrics ------------------------------------------------------------------------

def test_mismatch_sums_match_hand_computed_values():
    """r = pi_trainer / pi_behav = 2 and 0.5 on the two trained tokens (the third is
    padding): k1 sums -log r = 0; k3 sums r - 1 - log r = (1 - ln 2) + (-0.5 + ln 2) = 0.5;
    chi2 sums r^2 - 1 = 3 - 0.75 = 2.25."""
    behav = torch.tensor([-1.0, -1.0, -5.0])
    trainer = behav + torch.log(torch.tensor([2.0, 0.5, 100.0]))
    out = mismatch_sums(behav, trainer, torch.tensor([True, True, False]))
    assert out["mismatch_k1"] == pytest.approx(0.0, abs=1e-6)
    assert out["mismatch_k3"] == pytest.approx(0.5, rel=1e-5)
    assert out["mismatch_chi2"] == pytest.approx(2.25, rel=1e-5)


def test_k3_is_never_below_zero_where_the_engine_matches_the_trainer():
    """r - 1 - log r >= 0 for every r; in float32 a ratio within rounding of 1 gave
    -2.5e-9 per token in a real run (hf engine against its own trainer)."""
    from areal_ray.algo.is_correction import mismatch_sums
    g = torch.Generator().manual_seed(0)
    behav = (torch.randn(8, 64, generator=g) * 3 - 5).float()
    for eps in (0.0, 1e-7, 1e-6, 1e-5):
        trainer = (behav + eps * torch.randn(8, 64, generator=g)).float()
        sums = mismatch_sums(behav, trainer, torch.ones(8, 64))
        assert sums["mismatch_k3"] >= 0.0, (eps, sums)
