"""Micro-batch construction on one rank: whole groups per rank, budgets filled."""

from areal_ray.train.batching import build_microbatches, rank_share
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
