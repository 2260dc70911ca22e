"""The SFT loss by hand, and on a real model: the same as transformers' own masked-label
loss however the rows are micro-batched, and a few steps lower it."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.config import load_config
from areal_ray.sft.dataset import as_seqs, encode
from areal_ray.sft.step import completion_nll, eval_loss, sft_step
from areal_ray.task.tokenizer import load_tokenizer
from areal_ray.train.schedule import make_scheduler
from areal_ray.train.step import Models


def test_the_loss_is_the_masked_nll_over_the_batchs_completion_tokens():
    logp = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    mask = torch.tensor([False, True, True, False])
    assert completion_nll(logp, mask, normalizer=4).item() == pytest.approx((2 + 3) / 4)
    assert completion_nll(logp, torch.zeros(4, dtype=torch.bool), normalizer=0).item() == 0.0


def rows(tok):
    pairs = [("12+7=", "12+7=19.\\boxed{19}"), ("3-1+4=", "3-1=2,2+4=6.\\boxed{6}"), ("9=", "\\boxed{9}")]
    return [encode(str(i), p, c, tok, 64) for i, (p, c) in enumerate(pairs)]


def hf_loss(model, tok, rs) -> float:
    """transformers' causal LM loss, labels -100 on prompts and padding: its mean over
    every label token of the batch."""
    width = max(len(r.prompt_ids) + len(r.output_ids) for r in rs)
    ids = torch.full((len(rs), width), tok.pad_token_id)
    att = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rs):
        n = len(r.prompt_ids) + len(r.output_ids)
        ids[i, :n] = torch.tensor(r.prompt_ids + r.output_ids)
        att[i, :n] = 1
        labels[i, len(r.prompt_ids):n] = torch.tensor(r.output_ids)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=att, labels=labels).loss.item()


@pytest.mark.parametrize("pack,max_tokens", [(True, 8192), (True, 30), (False, 8192), (False, 30)])
def test_the_loss_is_transformers_masked_label_loss_however_micro_batched(random_model_dir, pack, max_tokens):
    tok = load_tokenizer(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    cfg = load_config("conf/sft.yaml", [f"algo.microbatch.pack={str(pack).lower()}",
                                        f"algo.microbatch.max_tokens={max_tokens}"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = Models(model, opt, make_scheduler(opt, 10, 0, "constant"))
    rs = rows(tok)
    assert eval_loss(m, as_seqs(rs), cfg, tok.pad_token_id) == pytest.approx(hf_loss(model, tok, rs), rel=1e-5)


def test_a_few_steps_lower_the_loss_and_leave_a_nonfinite_step_untaken(random_model_dir):
    tok = load_tokenizer(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    cfg = load_config("conf/sft.yaml")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    m = Models(model, opt, make_scheduler(opt, 10, 0, "constant"))
    seqs = as_seqs(rows(tok))
    first = eval_loss(m, seqs, cfg, tok.pad_token_id)
    for _ in range(5):
        stats = sft_step(m, seqs, cfg, tok.pad_token_id)
    assert stats["skipped_nonfinite"] == 0 and stats["n_tokens"] == sum(len(s["output_ids"]) for s in seqs)
    assert eval_loss(m, seqs, cfg, tok.pad_token_id) < first - 0.5

    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    before["model.norm.weight"] = model.model.norm.weight.clone()
    stats = sft_step(m, seqs, cfg, tok.pad_token_id)
    assert stats["skipped_nonfinite"] == 1 and "loss nan" in stats["nonfinite"]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) or k == "model.norm.weight" for k in before)
