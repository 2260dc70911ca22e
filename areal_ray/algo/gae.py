"""Generalised advantage estimation (GAE) over the generated tokens of one sequence.

Group estimators (`algo.advantages`) give one advantage per sample. With a critic,
or with per-token rewards (e.g. a KL penalty folded into the reward), each token
needs its own advantage, and GAE trades bias for variance through lambda:

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1}

with V after the last token = 0: generation ended, nothing more is earned. The
critic's regression target is returns = A + V. With gamma = lam = 1 (AReaL's
defaults) A_t = sum_{k>=t} r_k - V_t, and with no critic (V = 0) every token gets the
outcome reward: the outcome-reward setting that GRPO-style training uses.

The recursion runs over Python floats: a loop of small tensor ops costs microseconds
per token (minutes per batch of long answers), and a closed form with powers of
gamma * lam overflows on long sequences.
"""

from __future__ import annotations

import torch


def token_rewards(outcome: float, n: int) -> torch.Tensor:
    """Per-token rewards of a sequence of `n` generated tokens: the outcome reward on
    the last token (where it is earned), 0 elsewhere."""
    if n < 1:
        raise ValueError(f"a sequence needs at least one generated token, got n={n}")
    r = torch.zeros(n)
    r[-1] = float(outcome)
    return r


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) for one sequence; `rewards` and `values` are 1-D, one
    entry per generated token. Both outputs are detached float32 tensors of the same
    length (advantages are targets, not something to differentiate through)."""
    if rewards.dim() != 1 or rewards.shape != values.shape:
        raise ValueError(f"gae expects two 1-D tensors of one length, got rewards "
                         f"{tuple(rewards.shape)}, values {tuple(values.shape)}")
    r = rewards.detach().double().tolist()
    v = values.detach().double().tolist()
    adv = [0.0] * len(r)
    next_value, next_adv = 0.0, 0.0  # terminal: after the last token nothing follows
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * next_value - v[t]
        next_adv = delta + gamma * lam * next_adv
        adv[t], next_value = next_adv, v[t]
    returns = [a + b for a, b in zip(adv, v)]
    return (torch.tensor(adv, dtype=torch.float32, device=rewards.device),
            torch.tensor(returns, dtype=torch.float32, device=rewards.device))
