"""Clipped value loss against hand-computed values."""

import pytest
import torch

from areal_ray.algo.value import explained_variance, value_loss


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_clipped_loss_by_hand():
    v, old, ret, mask = t(1.0, 0.0, 50.0), t(0.5, 0.0, 0.0), t(2.0, 1.0, 0.0), t(1, 1, 0)
    loss, stats = value_loss(v, old, ret, mask, value_clip=0.2)
    # token 0: (1 - 2)^2 = 1; clipped v = 0.5 + 0.2 = 0.7, (0.7 - 2)^2 = 1.69 -> 0.845
    # token 1: v == old: 0.5 * (0 - 1)^2 = 0.5; token 2 is masked
    assert loss.item() == pytest.approx((0.845 + 0.5) / 2, rel=1e-5)
    assert stats["value_clip_frac"].item() == pytest.approx(0.5)
    assert stats["value_mean"].item() == pytest.approx(0.5)
    assert stats["return_mean"].item() == pytest.approx(1.5)
    # returns - values = (1, 1): no residual variance -> explained variance 1
    assert stats["explained_variance"].item() == pytest.approx(1.0)
    unclipped, _ = value_loss(v, old, ret, mask, value_clip=None)
    assert unclipped.item() == pytest.approx((0.5 + 0.5) / 2)
    halved, _ = value_loss(v, old, ret, mask, normalizer=4)
    assert halved.item() == pytest.approx((0.845 + 0.5) / 4, rel=1e-5)


def test_no_gain_from_moving_beyond_the_clip():
    # old 0, return 1: v = 1 has err 0, but the clipped value 0.2 has (0.8)^2 -> 0.32,
    # and its gradient is 0 (the clamp saturates).
    v = torch.tensor([1.0], requires_grad=True)
    loss, _ = value_loss(v, t(0.0), t(1.0), t(1))
    assert loss.item() == pytest.approx(0.32)
    loss.backward()
    assert v.grad.item() == 0.0
    # moving away instead: v = -1, err 4 > clipped (-0.2 - 1)^2 = 1.44; grad = v - R = -2
    v2 = torch.tensor([-1.0], requires_grad=True)
    loss2, _ = value_loss(v2, t(0.0), t(1.0), t(1))
    assert loss2.item() == pytest.approx(2.0)
    loss2.backward()
    assert v2.grad.item() == pytest.approx(-2.0)


def test_explained_variance_and_errors():
    # targets (0, 2) var 1; residuals (0 - 1, 2 - 1) = (-1, 1) var 1 -> 1 - 1 = 0
    assert explained_variance(t(1.0, 1.0), t(0.0, 2.0), t(1, 1)).item() == pytest.approx(0.0)
    assert explained_variance(t(1.0, 1.0), t(3.0, 3.0), t(1, 1)).item() == 0.0  # no variance
    with pytest.raises(ValueError, match="shapes differ"):
        value_loss(t(1.0), t(1.0), t(1.0, 2.0), t(1))
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(t(1.0), t(1.0), t(1.0), t(1), value_clip=0.0)
