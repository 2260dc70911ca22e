"""A multi-turn trajectory trains on its model tokens only: the trainer's loss (group ->
flattened sequences -> packed or padded micro-batches -> logprobs -> decoupled PPO
loss) equals a hand-built reference computed from the turns themselves, and nothing a
tool wrote (its ids, logprobs, versions) moves the loss or its gradient."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_ray.algo.loss import decoupled_ppo_loss
from areal_ray.config import Config
from areal_ray.train.batching import build_microbatches, forward_logprobs
from areal_ray.train.loop import flatten_groups
from areal_ray.types import Group, Sample

PROMPT = [5, 6, 7, 8]
TURN1, TOOL, TURN2 = [20, 21, 22, 23], [30, 31, 32], [40, 41, 2]
SINGLE = [24, 25, 26, 27, 28, 29, 2]
TEMP = 0.9


def multi_turn(tool_ids=TOOL, tool_logprob=0.0) -> Sample:
    out = TURN1 + tool_ids + TURN2
    return Sample(prompt_ids=PROMPT, output_ids=out,
                  logprobs=[-1.1, -0.7, -2.0, -0.4] + [tool_logprob] * len(tool_ids) + [-0.9, -1.5, -0.2],
                  versions=[3, 3, 4, 4] + [-1] * len(tool_ids) + [4, 4, 4], stop_reason="stop",
                  reward=1.0, loss_mask=[1] * 4 + [0] * len(tool_ids) + [1] * 3, n_turns=2,
                  tool_calls=1)


def single_turn() -> Sample:
    return Sample(prompt_ids=PROMPT, output_ids=SINGLE, logprobs=[-1.0] * len(SINGLE),
                  versions=[4] * len(SINGLE), stop_reason="stop", reward=0.0)


def trainer_loss(model, sample: Sample, packed: bool) -> torch.Tensor:
    cfg = Config()
    group = Group(ticket=0, uid="u", prompt="p", answer="a", verifier="math",
                  admitted_version=4, samples=[sample, single_turn()])
    seqs = flatten_groups([group], cfg.algo, max_new_tokens=64, trained_version=5)
    mbs = build_microbatches(seqs, max_tokens=256, packed=packed, pad_id=0)
    n = sum(int(mb["loss_mask"].sum()) for mb in mbs)
    total = 0.0
    for mb in mbs:
        logp = forward_logprobs(model, mb, TEMP)
        loss, _ = decoupled_ppo_loss(logp, mb["behavior_logprobs"], mb["behavior_logprobs"],
                                     mb["advantages"], mb["loss_mask"], eps_clip=0.2,
                                     normalizer=n)
        total = total + loss
    return total


def reference_loss(model) -> torch.Tensor:
    """PPO-clip by hand: per sequence one forward, the logprob of each model token at
    the position before it, ratio to its behaviour logprob, clipped surrogate, mean over
    the model tokens of both sequences. Group advantages: rewards 1 and 0 -> +-1/sqrt(2)
    (GRPO, std-normalised over the group of two, unbiased std)."""
    sample, other = multi_turn(), single_turn()
    adv = {0: 1.0 / 2 ** 0.5, 1: -1.0 / 2 ** 0.5}
    terms = []
    for k, (s, model_positions) in enumerate([
            (sample, list(range(4)) + [7, 8, 9]),  # turn 1 and turn 2; 4..6 are the tool's
            (other, list(range(len(SINGLE))))]):
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        logits = model(input_ids=ids).logits[0].float() / TEMP
        logp = torch.log_softmax(logits, -1)
        for j in model_positions:
            pos = len(s.prompt_ids) + j
            ratio = torch.exp(logp[pos - 1, ids[0, pos]] - s.logprobs[j])
            a = adv[k]
            terms.append(torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)))
    return torch.stack(terms).mean()


@pytest.fixture(scope="module")
def model(random_model_dir):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(random_model_dir, attn_implementation="sdpa")
    return m.float().eval()


def test_advantages_are_what_the_reference_assumes():
    group = Group(0, "u", "p", "a", "math", 4, samples=[multi_turn(), single_turn()])
    seqs = flatten_groups([group], Config().algo, max_new_tokens=64, trained_version=5)
    # (the estimator's epsilon in the std shifts them by ~1e-5)
    assert [s["advantage"] for s in seqs] == pytest.approx([2 ** -0.5, -2 ** -0.5], rel=1e-4)
    assert seqs[0]["staleness"] == 2  # trained at 5, oldest policy token at version 3


@pytest.mark.parametrize("packed", [True, False])
def test_trainer_loss_equals_the_hand_built_reference(model, packed):
    with torch.no_grad():
        got, want = trainer_loss(model, multi_turn(), packed), reference_loss(model)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), (float(got), float(want))


@pytest.mark.parametrize("packed", [True, False])
def test_tool_tokens_move_neither_loss_nor_gradient(model, packed):
    """Other tool-output ids change the context of turn 2 (so its logprobs), but the
    tool tokens' own behaviour logprobs do not enter the loss, and the loss has no
    gradient through the logits that predict tool tokens."""
    with torch.no_grad():
        a = trainer_loss(model, multi_turn(tool_logprob=0.0), packed)
        b = trainer_loss(model, multi_turn(tool_logprob=-7.0), packed)
    assert torch.equal(a, b)

    captured = {}
    hook = model.lm_head.register_forward_hook(
        lambda mod, inp, out: captured.setdefault("h", inp[0]).retain_grad())
    try:
        model.zero_grad()
        cfg_seqs = flatten_groups([Group(0, "u", "p", "a", "math", 4, samples=[multi_turn()])],
                                  Config().algo, 64, 5)
        cfg_seqs[0]["advantage"] = 1.0  # a lone sample's GRPO advantage is 0
        mb = build_microbatches(cfg_seqs, 256, packed, 0)[0]
        logp = forward_logprobs(model, mb, TEMP, chunk_bytes=1 << 40)
        loss, _ = decoupled_ppo_loss(logp, mb["behavior_logprobs"], mb["behavior_logprobs"],
                                     mb["advantages"], mb["loss_mask"])
        loss.backward()
    finally:
        hook.remove()
    grad = captured["h"].grad.reshape(-1, captured["h"].shape[-1]).abs().sum(-1)
    p = len(PROMPT)
    predicts_tool = [p - 1 + j for j in (4, 5, 6)]  # hidden states whose next token is the tool's
    predicts_model = [p - 1 + j for j in (0, 1, 2, 3, 7, 8, 9)]
    assert all(grad[i] == 0 for i in predicts_tool)
    assert all(grad[i] > 0 for i in predicts_model)
