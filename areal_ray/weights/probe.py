"""The load probe: a push that changed nothing is an error.

A replica can ack a push and keep serving the old weights: a load that silently
skipped tensors, a name mapping that matched nothing, an adapter request the engine
ignored (the reported "rollout keeps sampling the base model after a sync": verl
#7495, vLLM #34186). Acks say a load *ran*; the probe says what it *computes*.

After each push the trainer scores a fixed token sequence (`probe_ids`, 16 tokens) with
the weights it is pushing and tells the driver (`Driver.expect_probe`); each replica,
after its load, scores the same sequence with the weights it now serves and sends the
log-probabilities with its ack. The driver's `ProbeCheck` compares them: a replica
whose max |diff| exceeds the tolerance fails the push with an error naming it, the
version and the diff. Publications the trainer sent no probe for (the model on disk,
a restore after a restart, the final weights) are not checked.

Tolerance (`probe_atol`) follows the engine: the hf engine computes with the
trainer's own kernels on the same weights (bit-identical on float32 CPU runs, so its
default is tight), vLLM and sglang with their own kernels (and their LoRA term apart
from the base matmul: tests/rollout/engines/test_vllm_lora.py measures 2.4e-5), and
a narrower transfer or serving dtype rounds every weight. What the probe cannot see
is a step that moved the probe's logprobs by less than the tolerance: each check also
reports `signal`, how far this version's expected logprobs are from the previous
one's, so a record shows whether a skipped load would have been caught.

Pure: no torch, no ray (the driver actor imports it). The forward passes that produce
the log-probabilities are the trainer's (`train/probe.py`) and the engines' (`score`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROBE_TOKENS = 16
# A prime stride spreads the probe over the vocabulary; 3 skips the ids that are pad,
# bos and eos in many tokenizers (any ids would do: the probe only compares numbers).
_STRIDE, _START = 7919, 3

# Default max |logprob diff| per (engine, exact dtype): float32 weights served as sent
# (exact) or in a narrower dtype somewhere on the way (rounded).
PROBE_ATOL = {
    ("hf", True): 1e-5,      # the trainer's kernels and weights: 0.0 measured (full pushes)
    ("vllm", True): 1e-3,    # its own kernels (test_vllm.py: 1e-4; LoRA: 2.4e-5)
    ("sglang", True): 1e-2,  # not measured here (no GPU): loose
    ("hf", False): 5e-2, ("vllm", False): 5e-2, ("sglang", False): 5e-2,
}


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """The fixed probe sequence of a model with `vocab_size` ids."""
    if vocab_size <= _START:
        raise ValueError(f"a vocabulary of {vocab_size} ids is too small for the probe")
    span = vocab_size - _START
    return [_START + (i * _STRIDE) % span for i in range(n)]


# With LoRA the trainer computes x W^T + (x A^T B^T) s on the unmerged model while the
# hf engine serves the merged W + (B A) s: the same function, other rounding (measured
# up to 5.7e-6 over a 10-step LoRA quickstart, float32). The margin leaves room for
# adapters that keep growing over a long run.
LORA_ATOL = 1e-4


def probe_atol(backend: str, dtypes: tuple[str, ...], lora: bool = False) -> float:
    """The default tolerance for `backend` when the weights pass through `dtypes`
    (model.dtype, weights.dtype; empty entries ignored), with a LoRA adapter or not."""
    exact = all(d in ("", "float32") for d in dtypes)
    try:
        atol = PROBE_ATOL[(str(backend), exact)]
    except KeyError:
        raise ValueError(f"no probe tolerance for engine {backend!r}: set weights.probe_atol") from None
    return max(atol, LORA_ATOL) if lora else atol


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """max |a - b|, NaN when any entry is NaN (`max` alone would skip it: NaN compares
    false, so `max(0.0, nan)` is 0.0)."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


class ProbeMismatch(RuntimeError):
    """A replica's probe disagrees with the trainer's: its load did not apply."""


@dataclass(frozen=True)
class ProbeResult:
    replica_id: str
    version: int
    max_diff: float
    signal: float | None  # max |expected(v) - expected(previous)|; None for the first


class ProbeCheck:
    """The trainer's expected probe per version and each replica's verdict."""

    def __init__(self, atol: float):
        if atol < 0:
            raise ValueError(f"probe tolerance must be >= 0 (got {atol})")
        self.atol = atol
        self.expected: dict[int, tuple[list[int], list[float]]] = {}
        self._previous: list[float] | None = None
        self.signal: dict[int, float | None] = {}
        self.results: dict[int, list[ProbeResult]] = {}

    def expect(self, version: int, ids: list[int], logprobs: list[float]) -> None:
        """The trainer's own log-probabilities of `ids[1:]` for `version`."""
        if len(logprobs) != len(ids) - 1:
            raise ValueError(f"probe of v{version}: {len(logprobs)} logprobs for {len(ids)} ids")
        prev = self._previous
        self.signal[version] = (None if prev is None or len(prev) != len(logprobs)
                                else max_abs_diff(logprobs, prev))
        self._previous = list(logprobs)
        self.expected[version] = (list(ids), list(logprobs))
        for old in [v for v in self.expected if v < version - 2]:  # acks of older ones are late
            self.expected.pop(old)
            self.signal.pop(old, None)
            self.results.pop(old, None)

    def check(self, replica_id: str, version: int, probe: tuple[list[int], list[float]] | None
              ) -> ProbeResult | None:
        """Judge one replica's ack of `version`; None when nothing is expected of it (no
        probe from the trainer, or none from the replica for an unprobed publication).
        Raises ProbeMismatch naming the replica, the version and the max diff."""
        if version not in self.expected:
            return None
        ids, want = self.expected[version]
        if probe is None:
            raise ProbeMismatch(f"replica {replica_id} acked v{version} without a probe: "
                                "its engine cannot score one (InferenceEngine.score)")
        got_ids, got = probe
        if list(got_ids) != ids or len(got) != len(want):
            raise ProbeMismatch(f"replica {replica_id} scored another probe for v{version} "
                                f"({len(got_ids)} ids, {len(got)} logprobs) than the trainer's "
                                f"({len(ids)} ids): vocabularies differ?")
        diff = max_abs_diff(got, want)
        if not diff <= self.atol:  # NaN fails too
            raise ProbeMismatch(
                f"replica {replica_id} does not serve v{version}: its probe logprobs differ "
                f"from the trainer's by up to {diff:.3g} (tolerance {self.atol:.3g}); the "
                f"push did not apply (a skipped load, wrong names, an ignored adapter)"
                + (f"; one step moved them by {self.signal[version]:.3g}"
                   if self.signal.get(version) is not None else ""))
        result = ProbeResult(replica_id, version, diff, self.signal.get(version))
        self.results.setdefault(version, []).append(result)
        return result

    def summary(self, version: int) -> dict:
        """Step-record fields for `version`: the largest diff over its replicas and the
        signal a skipped load would have shown."""
        results = self.results.get(version, [])
        return {"probe_max_diff": max((r.max_diff for r in results), default=None),
                "probe_signal": self.signal.get(version)} if version in self.expected else {}


# Engines that can score the probe (`InferenceEngine.score`); sglang's is not written.
PROBED_BACKENDS = ("hf", "vllm")


def probe_enabled(cfg) -> bool:
    """Whether a run (a `Config`) probes its pushes: `weights.probe` on an engine that can."""
    return bool(cfg.weights.probe) and str(cfg.rollout.backend) in PROBED_BACKENDS


def run_probe_atol(cfg) -> float | None:
    """The driver's probe tolerance for a run; None when it does not probe."""
    if not probe_enabled(cfg):
        return None
    if cfg.weights.probe_atol is not None:
        return float(cfg.weights.probe_atol)
    return probe_atol(str(cfg.rollout.backend), (cfg.model.dtype, cfg.weights.dtype),
                      lora=cfg.model.lora.enabled)
