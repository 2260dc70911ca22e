"""sequence_mean: per-sequence means broadcast back to tokens, by hand."""

import pytest
import torch

from areal_ray.algo.gspo import sequence_mean


def test_means_by_hand_in_a_padded_layout():
    x = torch.tensor([[1.0, 3.0, 99.0], [2.0, 4.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ids = torch.tensor([[0, 0, -1], [1, 1, 1]])
    out = sequence_mean(x, ids, mask)
    # seq 0: (1 + 3) / 2 = 2 (99 is padding); seq 1: (2 + 4 + 9) / 3 = 5
    assert out.tolist() == [[2.0, 2.0, 0.0], [5.0, 5.0, 5.0]]
    out.sum().backward()
    # d(sum of seq 0's outputs)/dx_j = 2 * 1/2 = 1; seq 1: 3 * 1/3 = 1; padding 0
    assert x.grad.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_sequence_without_masked_tokens_and_empty_mask():
    x = torch.tensor([5.0, 7.0, 1.0])
    ids = torch.tensor([0, 2, 2])  # sequence 1 has no tokens here: no 0/0
    assert sequence_mean(x, ids, torch.tensor([1, 1, 1])).tolist() == [5.0, 4.0, 4.0]
    assert sequence_mean(x, ids, torch.tensor([0, 0, 0])).tolist() == [0.0, 0.0, 0.0]


def test_errors():
    with pytest.raises(ValueError, match="negative seq_id"):
        sequence_mean(torch.ones(2), torch.tensor([0, -1]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="shapes differ"):
        sequence_mean(torch.ones(2), torch.tensor([0]), torch.tensor([1, 1]))
