"""Micro-batch construction on one rank: whole groups per rank, budgets filled."""

from types import SimpleNamespace

import pytest
import torch

from areal_ray.train.batching import (
    DENSE_ROW_TOKENS,
    build_microbatches,
    dense_row_tokens,
    rank_share,
    to_device,
    uses_varlen,
)
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


def test_to_device_moves_every_tensor_and_nothing_else():
    from areal_ray.algo.packing import pack
    mb = dict(pack(make_seqs(3)), note="kept", ids=[1, 2])
    moved = to_device(mb, torch.device("meta"))  # any device other than the CPU shows the move
    tensors = {k for k, v in mb.items() if isinstance(v, torch.Tensor)}
    assert tensors >= {"input_ids", "position_ids", "loss_mask", "advantages", "attention_mask"}
    assert all(moved[k].device.type == "meta" and moved[k].dtype == mb[k].dtype
               and moved[k].shape == mb[k].shape for k in tensors)
    assert moved["note"] == "kept" and moved["ids"] is mb["ids"]
    assert mb["input_ids"].device.type == "cpu"  # the CPU micro-batch is left as it was
    assert to_device(None, torch.device("meta")) is None


@pytest.mark.parametrize("impl, varlen", [
    ("flash_attention_2", True), ("flash_attention_3", True),
    # what transformers 5.19 routes flash_attention_2 to when flash-attn is not installed
    ("kernels-community/flash-attn2", True), ("kernels-community/vllm-flash-attn3", True),
    ("sdpa", False), ("eager", False), (None, False)])
def test_varlen_follows_transformers_flash_detection(impl, varlen):
    assert uses_varlen(SimpleNamespace(_attn_implementation=impl)) is varlen


@pytest.mark.parametrize("varlen, longest", [(False, DENSE_ROW_TOKENS), (True, 8192)])
def test_dense_mask_rows_stop_at_the_row_cap_varlen_rows_fill_the_budget(varlen, longest):
    seqs = [dict(s, ticket=0) for s in make_seqs(120, seed=5)]
    total = sum(len(s["prompt_ids"]) + len(s["output_ids"]) for s in seqs)
    assert total > DENSE_ROW_TOKENS
    mbs = build_microbatches(seqs, max_tokens=8192, packed=True, pad_id=0, varlen=varlen)
    rows = [mb["input_ids"].shape[1] for mb in mbs]
    assert max(rows) <= longest and sum(rows) == total
    assert (len(mbs) == 1) is varlen  # without varlen: several rows of at most the cap
    assert ("attention_mask" in mbs[0]) is not varlen


QWEN_1_5B = "conf/models/qwen2.5-1.5b.json"


@pytest.mark.parametrize("device, model, expect", [
    ("cpu", QWEN_1_5B, "cap"),  # measured on CPU: the cap whatever the model
    ("cuda", QWEN_1_5B, "quarter"),  # a GPU: as long as attention stays a quarter of the work
    ("cuda", "tiny", "cap"),  # a model so small that a quarter is below the CPU cap
    ("cuda", "not-a-decoder", "cap"),  # a config without a decoder's sizes
])
def test_dense_rows_grow_on_a_gpu_while_attention_stays_a_quarter_of_the_work(
        device, model, expect, random_model_dir):
    from transformers import AutoConfig

    from areal_ray.train.memory import DecoderShape
    config = {QWEN_1_5B: lambda: AutoConfig.from_pretrained(QWEN_1_5B),
              "tiny": lambda: AutoConfig.from_pretrained(random_model_dir),
              "not-a-decoder": lambda: SimpleNamespace(model_type="other")}[model]()
    row = dense_row_tokens(config, torch.device(device))
    if expect == "cap":
        assert row == DENSE_ROW_TOKENS
        return
    s = DecoderShape.from_hf(config)
    def attention_share(t):  # a row's attention FLOPs per token over its other FLOPs
        return 4 * s.q_dim * s.layers * t / (2 * s.params)
    assert attention_share(row) <= 0.25 < attention_share(row + 1)
    assert 4000 < row < 5000  # ~3.5x fewer micro-batches than the CPU cap at Qwen's size


def test_rows_stop_at_the_dense_row_given():
    seqs = [dict(s, ticket=0) for s in make_seqs(120, seed=5)]
    mbs = build_microbatches(seqs, max_tokens=8192, packed=True, pad_id=0, dense_row=2048)
    rows = [mb["input_ids"].shape[1] for mb in mbs]
    assert max(rows) <= 2048 and max(rows) > DENSE_ROW_TOKENS
