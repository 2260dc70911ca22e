"""Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta.

A KL penalty towards a frozen reference model keeps the policy from drifting into
regions the reward model (or verifier) was never meant to judge. The exact KL needs
the full vocabulary distribution at every position; the trainer only has the
log-probability of the sampled token under each model, so it uses Schulman's
single-sample estimators (x = log pi_ref - log pi_theta at the sampled token):

* k1 = -x: unbiased, high variance, and negative on some tokens;
* k2 = x^2 / 2: biased, low variance, always >= 0;
* k3 = e^x - x - 1: unbiased and always >= 0 (the default).

Estimates are clamped to [-10, 10] (as AReaL does): one token the reference finds
absurdly unlikely would otherwise dominate the batch's penalty. The clamp also zeroes
that token's gradient, which is the intended effect.
"""

from __future__ import annotations

import torch

from areal_ray.config.choices import KlEstimator

KL_ESTIMATORS = KlEstimator.values()
KL_CLAMP = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref), same shape as `logprobs`; it
    carries gradient w.r.t. `logprobs` (computed in fp32)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"kl_estimate: shapes differ: logprobs {tuple(logprobs.shape)}, "
                         f"ref_logprobs {tuple(ref_logprobs.shape)}")
    log_ratio = logprobs.float() - ref_logprobs.float()  # log pi_theta / pi_ref
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.exp(-log_ratio) + log_ratio - 1.0
    return kl.clamp(-KL_CLAMP, KL_CLAMP)
