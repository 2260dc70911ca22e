"""GAE over one sequence against hand-computed values."""

import pytest
import torch

from areal_ray.algo.gae import gae, token_rewards

R = torch.tensor([0.0, 0.0, 1.0])  # outcome reward 1 on the last of 3 tokens
V = torch.tensor([0.2, 0.5, 0.7])


def test_token_rewards():
    assert token_rewards(2.0, 3).tolist() == [0.0, 0.0, 2.0]
    assert token_rewards(-1.0, 1).tolist() == [-1.0]
    with pytest.raises(ValueError):
        token_rewards(1.0, 0)


def test_gamma_lambda_one_is_return_minus_value():
    adv, ret = gae(R, V)
    assert adv.tolist() == pytest.approx([0.8, 0.5, 0.3])  # A_t = 1 - V_t
    assert ret.tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_gamma_lambda_by_hand():
    adv, ret = gae(R, V, gamma=0.9, lam=0.8)
    # delta_2 = 1 - 0.7 = 0.3                       A_2 = 0.3
    # delta_1 = 0.9 * 0.7 - 0.5 = 0.13             A_1 = 0.13 + 0.72 * 0.3 = 0.346
    # delta_0 = 0.9 * 0.5 - 0.2 = 0.25             A_0 = 0.25 + 0.72 * 0.346 = 0.49912
    assert adv.tolist() == pytest.approx([0.49912, 0.346, 0.3], rel=1e-6)
    assert ret.tolist() == pytest.approx([0.69912, 0.846, 1.0], rel=1e-6)


def test_no_critic_and_per_token_penalty():
    zero = torch.zeros(3)
    adv, _ = gae(R, zero)
    assert adv.tolist() == [1.0, 1.0, 1.0]  # every token gets the outcome
    adv, _ = gae(torch.tensor([-0.1, 0.0, 1.0]), zero)
    assert adv.tolist() == pytest.approx([0.9, 1.0, 1.0])  # a penalty counts from its token back


def test_shape_errors():
    with pytest.raises(ValueError):
        gae(R, V[:2])
    with pytest.raises(ValueError):
        gae(R[None], V[None])
