import pytest
import torch

from areal_ray.algo.advantages import (
    advantages,
    grpo_advantages,
    informative_groups,
    moments,
    normalize,
    rloo_advantages,
    shape_rewards,
)
from areal_ray.config.choices import AdvNorm


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


def test_rloo_by_hand():
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    # sample 0: 1 - mean(0, 0, 1) = 2/3 ; sample 1: 0 - mean(1, 0, 1) = -2/3
    assert adv[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert adv[1].tolist() == [0.0] * 4
    assert rloo_advantages(torch.tensor([[5.0]])).tolist() == [[0.0]]


@pytest.mark.parametrize("name,expected", [
    ("grpo", [1 / (2 ** 0.5 + 1e-5), -1 / (2 ** 0.5 + 1e-5)]),  # mean 2, unbiased std sqrt(2)
    ("dr_grpo", [1.0, -1.0]),
    ("rloo", [2.0, -2.0]),
])
def test_dispatch(name, expected):
    assert advantages(torch.tensor([[3.0, 1.0]]), name)[0].tolist() == pytest.approx(expected, rel=1e-5)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="ppo_magic"):
        advantages(torch.zeros(1, 2), "ppo_magic")


def test_reward_shaping_and_overlong_penalty():
    r = torch.tensor([[1.0, 0.0]])
    assert shape_rewards(r, bias=-0.5, scale=10.0).tolist() == [[5.0, -5.0]]
    assert shape_rewards(r, bias=-0.5, scale=10.0, clip=2.0).tolist() == [[2.0, -2.0]]
    lengths = torch.tensor([[90, 100]])  # max 100, ramp over the last 20 tokens
    out = shape_rewards(r, lengths=lengths, max_len=100, overlong_tokens=20, overlong_factor=1.0)
    assert out[0].tolist() == pytest.approx([1.0 - 0.5, 0.0 - 1.0])
    assert shape_rewards(r, lengths=torch.tensor([[10, 80]]), max_len=100,
                         overlong_tokens=20).tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="lengths"):
        shape_rewards(r, overlong_tokens=5)


def test_dynamic_filter_marks_groups_without_signal():
    keep = informative_groups(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
    assert keep.tolist() == [True, False, False]


def test_batch_normalize_by_hand():
    adv = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # masked entries 1, 2, 3: mean 2, unbiased std 1; the 100 is padding -> 0
    e = 1 / (1 + 1e-5)
    assert normalize(adv, mask).flatten().tolist() == pytest.approx([-e, 0.0, e, 0.0], rel=1e-6)
    # no mask: 0, 0, 0, 4: mean 1, unbiased std sqrt((1 + 1 + 1 + 9) / 3) = 2
    s = 2 + 1e-5
    out = normalize(torch.tensor([[0.0, 0.0], [0.0, 4.0]]))
    assert out.flatten().tolist() == pytest.approx([-1 / s, -1 / s, -1 / s, 3 / s], rel=1e-6)


def test_batch_normalize_degenerate_and_dispatch():
    assert normalize(torch.tensor([4.0, 5.0]), torch.tensor([1, 0])).tolist() == [0.0, 0.0]
    assert normalize(torch.tensor([4.0]), torch.tensor([0])).tolist() == [0.0]
    assert AdvNorm.values() == ("none", "batch")


def test_normalize_over_parts_equals_normalize_over_the_whole():
    """What data-parallel ranks do: sum the parts' moments, normalise each part."""
    whole = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    a, b = whole[:2], whole[2:]
    stats = [x + y for x, y in zip(moments(a), moments(b))]
    assert stats == [5.0, 20.0, 130.0]
    joined = torch.cat([normalize(a, stats=stats), normalize(b, stats=stats)])
    assert torch.allclose(joined, normalize(whole))
