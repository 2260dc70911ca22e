"""Packed forward == padded forward (logprobs to 1e-5); masks never cross sequences."""

import torch
from transformers import AutoModelForCausalLM

from areal_ray.algo.logprobs import pad_batch, token_logprobs
from areal_ray.algo.packing import pack, packed_token_logprobs


def make_seqs(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p = torch.randint(4, 80, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        o = torch.randint(4, 80, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        seqs.append({"prompt_ids": p, "output_ids": o, "logprobs": [-0.1 * (i + 1)] * len(o),
                     "versions": [i] * len(o), "advantage": float(i)})
    return seqs


def test_packed_logprobs_equal_padded(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir).eval()
    seqs = make_seqs()
    padded, packed = pad_batch(seqs, pad_id=0), pack(seqs)
    with torch.no_grad():
        lp_pad = token_logprobs(model, padded["input_ids"], padded["attention_mask"])
        lp_pack = packed_token_logprobs(model, packed)
    assert torch.allclose(lp_pack[packed["loss_mask"]], lp_pad[padded["loss_mask"]], atol=1e-5)
    for key in ("behavior_logprobs", "advantages", "versions", "seq_ids"):
        assert torch.equal(packed[key][packed["loss_mask"]], padded[key][padded["loss_mask"]])


def test_layout_and_no_cross_sequence_targets():
    seqs = make_seqs(3, seed=1)
    packed = pack(seqs)
    lens = [len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs]
    assert packed["input_ids"].shape == (1, sum(lens))
    assert packed["cu_seqlens"].tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert int(packed["loss_mask"].sum()) == sum(len(s["output_ids"]) for s in seqs)
    for end in packed["cu_seqlens"][1:-1].tolist():
        assert not packed["loss_mask"][end - 1]  # last token of a sequence predicts nothing
    mask = packed["attention_mask"][0, 0]
    assert not mask[lens[0], lens[0] - 1]  # the 2nd sequence cannot see the 1st
    assert mask[lens[0] + 1, lens[0]]
    assert "attention_mask" not in pack(seqs, build_mask=False)  # flash-attn varlen path


def test_seq_ids_name_each_output_token_by_hand():
    seqs = [{"prompt_ids": [1, 2], "output_ids": [3], "logprobs": [-0.5], "versions": [0],
             "advantage": 1.0},
            {"prompt_ids": [4], "output_ids": [5, 6], "logprobs": [-0.1, -0.2],
             "versions": [1, 1], "advantage": -1.0}]
    # packed row 1 2 3 4 5 6; target i predicts token i+1: seq 0 predicts "3" at 1,
    # seq 1 predicts "5", "6" at 3, 4; position 2 ("3" -> "4") crosses a boundary.
    assert pack(seqs)["seq_ids"].tolist() == [-1, 0, -1, 1, 1]
    # padded rows [1 2 3] and [4 5 6]: targets [-, 3] and [5, 6]
    assert pad_batch(seqs, pad_id=0)["seq_ids"].tolist() == [[-1, 0], [1, 1]]
