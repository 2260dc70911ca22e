"""kl_estimate against hand-computed k1/k2/k3 values, including the clamp."""

import math

import pytest
import torch

from areal_ray.algo.kl import KL_ESTIMATORS, kl_estimate

# log pi_theta - log pi_ref = (0.5, -1, 20); the last one exceeds every clamp.
LP = torch.tensor([-1.0, -2.0, 0.0])
REF = torch.tensor([-1.5, -1.0, -20.0])


@pytest.mark.parametrize("kind,expected", [
    ("k1", [0.5, -1.0, 10.0]),                      # lp - ref, 20 clamped to 10
    ("k2", [0.125, 0.5, 10.0]),                     # (lp - ref)^2 / 2, 200 clamped
    ("k3", [math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0, 10.0]),  # e^x - x - 1, x = ref - lp
])
def test_estimators_by_hand(kind, expected):
    assert kl_estimate(LP, REF, kind).tolist() == pytest.approx(expected, rel=1e-5)


def test_default_is_k3_and_zero_when_equal():
    assert torch.equal(kl_estimate(LP, REF), kl_estimate(LP, REF, "k3"))
    assert kl_estimate(LP, LP).tolist() == [0.0, 0.0, 0.0]


def test_gradient_of_k3():
    lp = torch.tensor([-1.0], requires_grad=True)
    kl_estimate(lp, torch.tensor([-2.0])).sum().backward()
    assert lp.grad.item() == pytest.approx(1 - math.exp(-1.0), rel=1e-5)  # 1 - e^(ref - lp)


def test_errors():
    assert KL_ESTIMATORS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(LP, REF, "k4")
    with pytest.raises(ValueError, match="shapes differ"):
        kl_estimate(LP, REF[:2])
