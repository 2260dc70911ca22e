"""The trainer's step on one process: advantages, staleness, and a real optimizer step."""

import torch
from transformers import AutoModelForCausalLM

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.config import load_config
from areal_ray.rollout.engine import GenerationRequest
from areal_ray.rollout.hf_engine import HFEngine
from areal_ray.train.loop import flatten_groups, train_step
from areal_ray.types import Group, Sample


def make_groups(engine, rewards_per_group, version=0):
    groups = []
    for gi, rewards in enumerate(rewards_per_group):
        reqs = [GenerationRequest([5, 6, 7 + gi], 8, 1.0, ignore_eos=True) for _ in rewards]
        res = engine.generate_batch(reqs, version)
        samples = [Sample(q.input_ids, r.output_ids, r.logprobs, r.versions, r.stop_reason, reward=rw)
                   for q, r, rw in zip(reqs, res, rewards)]
        groups.append(Group(gi, f"u{gi}", "p", "1", "math", version, samples))
    return groups


def test_flatten_groups_advantages_and_staleness(random_model_dir):
    engine = HFEngine(random_model_dir)
    groups = make_groups(engine, [[1.0, 0.0], [1.0, 1.0]], version=2)
    algo = load_config(None, ["algo.adv_estimator=dr_grpo"]).algo
    seqs = flatten_groups(groups, algo, max_new_tokens=8, trained_version=5)
    assert [s["advantage"] for s in seqs] == [0.5, -0.5, 0.0, 0.0]
    assert {s["staleness"] for s in seqs} == {3}


def test_train_step_raises_the_logprob_of_rewarded_samples(random_model_dir):
    torch.manual_seed(0)
    engine = HFEngine(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    cfg = load_config(None, ["algo.lr=1e-2"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.algo.lr)
    seqs = flatten_groups(make_groups(engine, [[1.0, 0.0, 0.0, 0.0]]), cfg.algo, 8, 0)

    def seq_logprob(s):
        b = pad_batch([s], engine.pad_id)
        with torch.no_grad():
            return token_logprobs(model, b["input_ids"], b["attention_mask"])[b["loss_mask"]].sum()

    before = [seq_logprob(s) for s in seqs]
    stats = train_step(model, opt, seqs, cfg, engine.pad_id)
    after = [seq_logprob(s) for s in seqs]
    assert after[0] > before[0]  # the rewarded sample became more likely
    assert all(a < b for a, b in zip(after[1:], before[1:]))
    assert abs(stats["behav_weight_mean"] - 1.0) < 1e-3  # fresh samples: pi_prox == pi_behav
    assert stats["n_microbatches"] == 1 and stats["grad_norm"] > 0
