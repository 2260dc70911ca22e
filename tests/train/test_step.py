"""train_step on one process with real models: every algorithm option really trains."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.config import load_config
from areal_ray.rollout.engines.hf import HFEngine
from areal_ray.train.critic import load_critic
from areal_ray.train.loop import flatten_groups
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models, normalize_advantages, train_step
from tests.algo.test_packing import make_seqs
from tests.train.test_loop import make_groups


def models(model, opt, **kw) -> Models:
    return Models(model, opt, make_scheduler(opt, 10, 0, "constant"), **kw)


def count_forwards(model) -> list:
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_packed_and_padded_steps_give_the_same_update(random_model_dir):
    seqs = [dict(s, ticket=0) for s in make_seqs(6)]
    results = []
    for packed in (True, False):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(random_model_dir)
        cfg = load_config(None, [f"algo.microbatch.pack={packed}", "algo.microbatch.max_tokens=64", "algo.optim.lr=1e-2"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg.algo.optim.lr)
        stats = train_step(models(model, opt), copy.deepcopy(seqs), cfg, pad_id=0, version=0)
        results.append((stats, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (s_pack, w_pack), (s_pad, w_pad) = results
    assert abs(s_pack["loss"] - s_pad["loss"]) < 1e-5
    assert all(torch.allclose(w_pack[k], w_pad[k], atol=1e-5) for k in w_pack)


def test_one_minibatch_uses_the_loss_forward_as_pi_prox_exactly(random_model_dir):
    """With one optimizer step per batch, pi_prox == the weights of the loss forward:
    the step's loss equals one computed with a separate no-grad proximal pass."""
    from areal_ray.algo.loss import decoupled_ppo_loss
    from areal_ray.algo.packing import pack, packed_token_logprobs

    seqs = [dict(s, ticket=0) for s in make_seqs(4)]
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    mb = pack(seqs)
    with torch.no_grad():
        prox = packed_token_logprobs(model, mb)
        expected, _ = decoupled_ppo_loss(prox, prox, mb["behavior_logprobs"], mb["advantages"],
                                         mb["loss_mask"], behav_imp_weight_cap=5.0)
    cfg = load_config(None, ["algo.optim.ppo_minibatches=1"])
    forwards = count_forwards(model)
    stats = train_step(models(model, torch.optim.SGD(model.parameters(), lr=0.0)), seqs, cfg, 0, 0)
    assert abs(stats["loss"] - expected.item()) < 1e-6
    assert len(forwards) == stats["n_microbatches"] == 1  # no separate proximal pass


@pytest.mark.parametrize("prox,extra_forwards", [("recompute", 2), ("loglinear", 0)])
def test_several_minibatches_recompute_or_approximate_pi_prox(random_model_dir, prox, extra_forwards):
    seqs = [dict(s, ticket=t) for t in range(4) for s in make_seqs(2, seed=t)]
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = load_config(None, ["algo.optim.ppo_minibatches=2", "algo.batch_groups=4",
                             f"algo.loss.prox_logp={prox}"])
    forwards = count_forwards(model)
    stats = train_step(models(model, torch.optim.SGD(model.parameters(), lr=1e-1)), seqs, cfg, 0, 0)
    assert len(forwards) == stats["n_microbatches"] + extra_forwards
    assert stats["approx_kl"] > 0  # the 2nd minibatch ran on updated weights vs pi_prox
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("overrides", [
    [], ["algo.adv.estimator=rloo"], ["algo.loss.importance_level=sequence"],
    ["algo.loss.kl_coef=0.1"], ["algo.adv.estimator=gae"], ["algo.adv.norm=batch"],
], ids=["grpo", "rloo", "gspo", "kl", "gae", "adv_norm"])
def test_each_recipe_raises_the_logprob_of_the_rewarded_sample(random_model_dir, overrides):
    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    cfg = load_config(None, ["algo.optim.lr=1e-2", "algo.critic.lr=1e-2", *overrides])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.algo.optim.lr)
    m = models(model, opt)
    if cfg.algo.loss.kl_coef > 0:
        m.ref = AutoModelForCausalLM.from_pretrained(random_model_dir).requires_grad_(False)
    if cfg.algo.adv.estimator == "gae":
        m.critic = load_critic(random_model_dir)
        m.critic_opt = torch.optim.AdamW(m.critic.parameters(), lr=cfg.algo.critic.lr)
        critic_before = {k: v.clone() for k, v in m.critic.state_dict().items()}
    seqs = flatten_groups(make_groups(engine, [[1.0, 0.0, 0.0, 0.0]]), cfg.algo, 8, 0)

    def seq_logprob(s):
        b = pad_batch([s], engine.pad_id)
        with torch.no_grad():
            return token_logprobs(model, b["input_ids"], b["attention_mask"])[b["loss_mask"]].sum()

    before = [seq_logprob(s) for s in seqs]
    stats = train_step(m, seqs, cfg, engine.pad_id, version=0)
    after = [seq_logprob(s) for s in seqs]
    assert after[0] > before[0]  # the rewarded sample became more likely
    assert abs(stats["behav_weight_mean"] - 1.0) < 1e-3  # fresh samples: pi_prox == pi_behav
    assert stats["n_microbatches"] == 1 and stats["grad_norm"] > 0
    if cfg.algo.loss.kl_coef > 0:
        assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # pi_theta == pi_ref before the step
        assert train_step(m, seqs, cfg, engine.pad_id, version=1)["kl_ref"] > 0
    if cfg.algo.adv.estimator == "gae":
        assert stats["value_loss"] > 0
        assert any(not torch.equal(critic_before[k], v) for k, v in m.critic.state_dict().items())


def test_batch_normalised_advantages_have_zero_mean_unit_std():
    from areal_ray.algo.packing import pack
    mbs = [pack(make_seqs(3, seed=1)), None, pack(make_seqs(2, seed=2))]
    for k, mb in enumerate(m for m in mbs if m is not None):
        mb["advantages"] = torch.where(mb["loss_mask"], torch.randn(mb["loss_mask"].shape) + 3 * k, 0.0)
    normalize_advantages(mbs)
    a = torch.cat([mb["advantages"][mb["loss_mask"]] for mb in mbs if mb is not None])
    assert abs(float(a.mean())) < 1e-5 and abs(float(a.std()) - 1.0) < 1e-4


TOY_CALLS = []


def toy_loss(x, cfg):
    """A registered loss of the documented signature (algo/losses.py): REINFORCE on the
    token mean, reporting no stats."""
    TOY_CALLS.append((x.logprobs.shape, cfg.eps_clip, sorted(x.batch)))
    return -(x.logprobs * x.advantages * x.loss_mask).sum() / x.normalizer, {}


def test_a_registered_loss_is_what_train_step_minimises(random_model_dir, monkeypatch):
    from areal_ray.algo import losses
    from areal_ray.algo.packing import pack, packed_token_logprobs

    monkeypatch.setitem(losses.LOSSES, "toy", f"{__name__}:toy_loss")
    TOY_CALLS.clear()
    seqs = [dict(s, ticket=0) for s in make_seqs(4)]
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    mb = pack(seqs)
    with torch.no_grad():
        lp = packed_token_logprobs(model, mb)
        expected = -(lp * mb["advantages"] * mb["loss_mask"]).sum() / mb["loss_mask"].sum()
    cfg = load_config(None)
    cfg.algo.loss.name = "toy"  # the config's choices are read from the registry at import
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = train_step(models(model, torch.optim.SGD(model.parameters(), lr=1e-1)), seqs, cfg, 0, 0)
    assert len(TOY_CALLS) == stats["n_microbatches"] == 1
    assert TOY_CALLS[0][1] == cfg.algo.loss.eps_clip and "versions" in TOY_CALLS[0][2]
    assert abs(stats["loss"] - expected.item()) < 1e-6
    assert stats["skipped_nonfinite"] == 0
    assert all(stats[k] != stats[k] for k in ("clip_frac", "approx_kl", "behav_weight_max"))  # NaN: not reported
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
