"""train_step's entropy and engine/trainer mismatch metrics, the entropy bonus and the
mismatch corrections, on one process with a real tiny model."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.algo.packing import pack, packed_token_logprobs
from areal_ray.config import load_config
from areal_ray.train.step import train_step
from tests.algo.test_packing import make_seqs
from tests.train.test_step import models


def step(model_dir, seqs, overrides, lr=0.0):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = load_config(None, ["algo.microbatch.max_tokens=64", *overrides])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, train_step(models(model, opt), copy.deepcopy(seqs), cfg, pad_id=0, version=0)


def test_entropy_and_mismatch_equal_a_direct_computation(random_model_dir):
    seqs = [dict(s, ticket=0) for s in make_seqs(6)]
    model, stats = step(random_model_dir, seqs, ["rollout.temperature=0.9"])
    mb = pack(seqs)
    mask = mb["loss_mask"]
    with torch.no_grad():
        trainer = packed_token_logprobs(model, mb, 0.9)[mask]
        kw = {k: mb[k] for k in ("input_ids", "position_ids", "attention_mask") if k in mb}
        logits = model(**kw).logits[0, :-1]
        ent = torch.distributions.Categorical(logits=logits.float() / 0.9).entropy()[mask]
    behav = mb["behavior_logprobs"][mask]
    log_r = trainer - behav
    assert stats["entropy"] == pytest.approx(ent.mean().item(), rel=1e-4)
    assert stats["mismatch_kl"] == pytest.approx((-log_r).mean().item(), rel=1e-4)
    assert stats["mismatch_k3"] == pytest.approx((log_r.exp() - 1 - log_r).mean().item(), rel=1e-4)
    assert stats["mismatch_chi2"] == pytest.approx((log_r.exp() ** 2 - 1).mean().item(), rel=1e-4)
    assert stats["mismatch_ppl_ratio"] == pytest.approx(math.exp(stats["mismatch_kl"]), rel=1e-6)
    # make_seqs' sequence i was generated at version i: at version 0 only the first is fresh
    fresh = (mb["versions"] == 0)[mask]
    assert 0 < fresh.sum() < mask.sum()
    assert stats["fresh_frac"] == pytest.approx(fresh.float().mean().item())
    k3 = log_r.exp() - 1 - log_r
    assert stats["mismatch_k3_fresh"] == pytest.approx(k3[fresh].mean().item(), rel=1e-4)
    assert stats["mismatch_k3_fresh"] != pytest.approx(stats["mismatch_k3"], rel=1e-3)


def test_the_entropy_bonus_raises_the_entropy(random_model_dir):
    """With zero advantages the policy term has no gradient: the bonus alone moves the
    weights, towards a higher entropy on the trained tokens; without it nothing moves."""
    seqs = [dict(s, ticket=0, advantage=0.0) for s in make_seqs(6)]
    for coef, moves in ((0.0, False), (1.0, True)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(random_model_dir)
        cfg = load_config(None, [f"algo.loss.entropy_coef={coef}", "algo.optim.max_grad_norm=1e9"])
        m = models(model, torch.optim.SGD(model.parameters(), lr=0.5))
        before = train_step(m, copy.deepcopy(seqs), cfg, 0, 0)["entropy"]
        after = train_step(m, copy.deepcopy(seqs), cfg, 0, 1)["entropy"]
        if moves:
            assert after > before + 1e-4
        else:
            assert after == pytest.approx(before, abs=1e-6)


@pytest.mark.parametrize("overrides", [
    # every mode is checked by hand in tests/algo/test_correction.py; here, that each
    # kind (token weight, sequence weight, geometric mask, pure mask) runs in a step
    *[[f"algo.loss.correction.mode={mode}"] for mode in ("token_tis", "seq_tis", "geo_mis", "icepop")],
    ["algo.loss.name=cispo"],
    ["algo.loss.name=cispo", "algo.loss.correction.mode=token_tis"],
    ["algo.loss.correction.mode=seq_mis", "algo.loss.importance_level=sequence"],
])
def test_every_correction_trains_and_reports_what_it_masked(random_model_dir, overrides):
    seqs = [dict(s, ticket=0) for s in make_seqs(6)]
    model, stats = step(random_model_dir, seqs, overrides, lr=1e-2)
    assert math.isfinite(stats["loss"]) and stats["skipped_nonfinite"] == 0
    for key in ("correction_masked_frac", "correction_truncated_frac"):
        assert 0.0 <= stats[key] <= 1.0
    # make_seqs' behaviour logprobs (-0.1 .. -0.6) are far from the model's: IcePop's
    # band acts on this batch
    if "icepop" in overrides[0]:
        assert stats["correction_masked_frac"] > 0
    if overrides == ["algo.loss.correction.mode=token_tis"]:
        assert stats["correction_truncated_frac"] == 0.0  # pi_prox < pi_behav: w < 1 < C


def test_the_entropy_bonus_gives_a_sharded_model_the_plain_models_update(random_model_dir,
                                                                         one_rank_group):
    """The entropy leaves the model as part of its output, so FSDP2 reduces its gradient
    like the logprobs': the bonus alone (zero advantages) moves a sharded model as it
    moves the plain one."""
    from areal_ray.train.fsdp import full_state_dict, load_sharded_model

    seqs = [dict(s, ticket=0, advantage=0.0) for s in make_seqs(4)]
    cfg = load_config(None, ["algo.loss.entropy_coef=1.0", "algo.microbatch.max_tokens=64",
                             "algo.optim.max_grad_norm=1e9"])
    after = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = (load_sharded_model(random_model_dir, device=torch.device("cpu")) if sharded
                 else AutoModelForCausalLM.from_pretrained(random_model_dir))
        train_step(models(model, torch.optim.SGD(model.parameters(), lr=0.5)),
                   copy.deepcopy(seqs), cfg, 0, 0)
        after.append(full_state_dict(model) if sharded else model.state_dict())
    plain, sharded = after
    base = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    assert any(not torch.equal(plain[k], base[k]) for k in base)
    for k in base:
        torch.testing.assert_close(sharded[k], plain[k], rtol=1e-4, atol=1e-6)
