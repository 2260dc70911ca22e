"""Micro-batch construction on one rank, and packed vs padded training steps agreeing."""

import copy

import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.train.batching import build_microbatches, rank_share
from areal_ray.train.loop import train_step
from tests.algo.test_packing import make_seqs


def test_rank_share_keeps_groups_whole():
    seqs = [dict(s, ticket=t) for t in range(4) for s in make_seqs(3, seed=t)]
    shares = [rank_share(seqs, r, 2) for r in range(2)]
    assert sum(len(x) for x in shares) == len(seqs)
    for share in shares:
        for t in {s["ticket"] for s in share}:
            assert sum(s["ticket"] == t for s in share) == 3


def test_microbatches_fill_the_budget():
    seqs = make_seqs(8)
    packed = build_microbatches(seqs, max_tokens=64, packed=True, pad_id=0)
    assert all(mb["input_ids"].shape[1] <= 64 for mb in packed)
    assert sum(int(mb["loss_mask"].sum()) for mb in packed) == sum(len(s["output_ids"]) for s in seqs)
    padded = build_microbatches(seqs, max_tokens=64, packed=False, pad_id=0)
    assert sum(int(mb["loss_mask"].sum()) for mb in padded) == sum(len(s["output_ids"]) for s in seqs)


def test_packed_and_padded_steps_give_the_same_update(random_model_dir):
    seqs = [dict(s, ticket=0) for s in make_seqs(6)]
    results = []
    for packed in (True, False):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(random_model_dir)
        cfg = load_config(None, [f"algo.pack={packed}", "algo.max_tokens_per_mb=64", "algo.lr=1e-2"])
        opt = torch.optim.SGD(model.parameters(), lr=cfg.algo.lr)
        stats = train_step(model, opt, copy.deepcopy(seqs), cfg, pad_id=0)
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
    cfg = load_config(None, ["algo.ppo_minibatches=1"])
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), seqs, cfg, pad_id=0)
    assert abs(stats["loss"] - expected.item()) < 1e-6
    assert len(forwards) == stats["n_microbatches"] == 1  # no separate proximal pass


def test_several_minibatches_recompute_pi_prox_and_step_each(random_model_dir):
    seqs = [dict(s, ticket=t) for t in range(4) for s in make_seqs(2, seed=t)]
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = load_config(None, ["algo.ppo_minibatches=2", "algo.batch_groups=4"])
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1e-1), seqs, cfg, pad_id=0)
    assert stats["approx_kl"] > 0  # the 2nd minibatch ran on updated weights vs pi_prox
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
