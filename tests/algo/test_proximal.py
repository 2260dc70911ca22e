"""Log-linear proximal approximation: alpha by staleness, by hand."""

import pytest
import torch

from areal_ray.algo.proximal import loglinear_alpha, loglinear_proximal_logprobs


def test_alpha_by_staleness():
    # prox_version 5, trained weights count as 6: alpha = (5 - v) / (6 - v)
    versions = torch.tensor([-1, 5, 4, 2, 0, 6])
    alpha = loglinear_alpha(versions, prox_version=5)
    # prompt/pad 0; fresh 0; 1 behind 1/2; 3 behind 3/4; 5 behind 5/6; newer (bogus) 0
    assert alpha.tolist() == pytest.approx([0.0, 0.0, 0.5, 0.75, 5 / 6, 0.0])


def test_interpolates_in_log_space_and_is_detached():
    lp = torch.tensor([-9.0, -1.0, -1.0, -1.0], requires_grad=True)
    beh = torch.tensor([0.0, -2.0, -2.0, -2.0])
    versions = torch.tensor([-1, 3, 2, 0])
    prox = loglinear_proximal_logprobs(lp, beh, versions, prox_version=3)
    # behav + alpha * (lp - behav), alpha = 0, 0, 1/2, 3/4
    assert prox.tolist() == pytest.approx([0.0, -2.0, -1.5, -1.25])
    assert not prox.requires_grad
    assert prox[1].item() == beh[1].item()  # a fresh token gets its behaviour log-prob exactly


def test_shape_error():
    with pytest.raises(ValueError, match="shapes differ"):
        loglinear_proximal_logprobs(torch.zeros(2), torch.zeros(2), torch.zeros(3), 0)
