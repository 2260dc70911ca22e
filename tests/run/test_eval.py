"""The unbiased pass@k estimator, checked against hand-computed values."""

import pytest

from areal_ray.run.eval import pass_at_k


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 2, 0.0), (4, 4, 2, 1.0), (4, 1, 1, 0.25), (4, 2, 2, 1 - 1 / 6), (5, 3, 3, 1.0),
    (8, 1, 8, 1.0), (8, 1, 4, 0.5),
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError, match="at least 4 samples"):
        pass_at_k(3, 1, 4)
