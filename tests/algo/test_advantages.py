import pytest
import torch

from areal_ray.algo.advantages import grpo_advantages


def test_group_normalised_by_hand():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    a = 0.5 / ((1 / 3) ** 0.5 + 1e-5)  # mean 0.5, unbiased std sqrt(1/3)
    assert adv[0].tolist() == pytest.approx([a, -a, -a, a], rel=1e-5)
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # all-equal group: no signal


def test_mean_only_and_bad_shape():
    adv = grpo_advantages(torch.tensor([[3.0, 1.0]]), std_normalize=False)
    assert adv.tolist() == [[1.0, -1.0]]
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]))
