"""The table of training/inference mismatch corrections (`algo.loss.correction.mode`).

Torch-free, like the loss table (algo/losses.py), so the config can list the choices
(config/choices.py) without importing torch; the tensor code is algo/is_correction.py.

Each correction decides, from the behaviour weight w = pi_prox / pi_behav, a
continuous *weight* (importance sampling, IS) and a binary *mask* (rejection
sampling, RS), kept apart as verl's "rollout correction" keeps them: the IS level
(token: w_t; sequence: the product of a sequence's w_t), whether that weight is
truncated at `is_threshold` (TIS), and the RS level (token, sequence product, or
geometric mean per sequence) with its band [lower, upper]. Adding one is a line here.
"""

from __future__ import annotations

from dataclasses import dataclass

OFF = "off"


@dataclass(frozen=True)
class Mode:
    """One correction: what weights a token and what masks it."""

    weight: str | None  # "token" | "sequence" | None (weight 1: a pure mask)
    truncate: bool  # weight = min(weight, is_threshold)
    mask: str | None  # "token" | "sequence" | "geometric" | None
    upper: float | None = None  # the mask band's default upper bound; None: is_threshold
    lower: float | None = None  # its default lower bound; None: 1 / upper
    help: str = ""


# verl names in the help: rollout_is (weight level), rollout_rs (mask level).
CORRECTIONS: dict[str, Mode] = {
    "token_tis": Mode("token", True, None,
                      help="token TIS: weight min(w_t, C) (verl rollout_is=token)"),
    "seq_tis": Mode("sequence", True, None,
                    help="sequence TIS: weight min(prod w_t, C) on every token of the sequence "
                         "(verl rollout_is=sequence)"),
    "token_mis": Mode("token", False, "token",
                      help="token masked IS: weight w_t, tokens with w_t outside [lower, upper] "
                           "masked (verl rollout_is=token + rollout_rs=token)"),
    "seq_mis": Mode("sequence", False, "sequence",
                    help="sequence masked IS: weight prod w_t, sequences whose product is outside "
                         "[lower, upper] masked (verl rollout_is=sequence + rollout_rs=sequence)"),
    "geo_mis": Mode("token", True, "geometric", upper=1.001,
                    help="geometric mask + token TIS (seq-mask-tis): sequences whose geometric-mean "
                         "w is outside [lower, upper] masked, token weights min(w_t, C)"),
    "icepop": Mode(None, False, "token", upper=5.0, lower=0.5,
                   help="IcePop: tokens with w_t outside [0.5, 5] masked, no weight"),
}


def bounds(mode: Mode, is_threshold: float, rs_threshold: float | None,
           rs_threshold_lower: float | None) -> tuple[float, float]:
    """The mask band: the configured bounds, else the mode's defaults, else verl's
    (upper = is_threshold, lower = 1 / upper)."""
    upper = rs_threshold if rs_threshold is not None else (mode.upper or is_threshold)
    lower = rs_threshold_lower if rs_threshold_lower is not None else (mode.lower or 1.0 / upper)
    return lower, upper
