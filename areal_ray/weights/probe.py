"""The load probe: a push that changed nothing is an error.

A replica can ack a push and keep serving the old weights: a load that silently
skipped tensors, a name mapping that matched nothing, an adapter request the engine
ignored (the reported "rollout keeps sampling the base model after a sync": verl
#7495, vLLM #34186). Acks say a load *ran*; the probe says what it *computes*.

After each push the trainer scores a fixed token sequence (`probe_ids`, 16 tokens) with
the weights it is pushing and tells the driver (`Driver.expect_probe`); each replica,
after its load, scores the same sequence with the weights it now serves and sends the
log-probabilities with its ack. The driver's `ProbeCheck` judges them by one of two
rules (`ProbeRule`), chosen by the run's dtypes:

- **exact** (float32 end to end): max |engine - trainer| within a tolerance measured per
  engine (`PROBE_ATOL`). The hf engine runs the trainer's own kernels on the same
  weights (bit-identical on CPU), vLLM its own (1e-4 measured). A tight bound also
  catches a load that applied only part of the tensors.
- **moved** (any narrower dtype on the way: bf16 compute, a bf16 transfer). Engine and
  trainer kernels then disagree by an amount nobody can fix in advance: fused norms,
  other GEMM shapes and attention kernels over many layers, bf16 logits 0.125 apart
  at magnitude 16-32; vLLM vs transformers on a 1.7B model in bf16 differ by up to 0.32
  per token (vllm#18352). So no fixed bound is used. Instead each replica's gap to the
  trainer is *measured* where both hold identical weights (the model on disk at
  version 0: the replica scores it when it registers, the trainer when it starts), and
  each push must move the engine's probe toward the trainer's by most of the trainer's
  own change since that anchor: with s = t_v - t_a (the trainer's change) and
  m = e_v - e_a (the engine's), the share r = m.s / |s|^2 must be >= 0.5. A load that
  did not apply leaves the engine where it was (r ~ 0); one that applied follows
  (r ~ 1). Kernel noise n enters r as (n_v - n_a).s / |s|^2, at most
  |n_v - n_a| / |s| <= 2|n| / |s|; the rule judges only when |s| exceeds
  `clear` (6) times the measured gap, which bounds that term by 1/3, so an applied
  load scores r >= 0.67 and a skipped one r <= 0.33 whatever the kernels do. A change
  inside the noise cannot be judged: the check passes as *unseen* and keeps its
  anchor, so a load that keeps failing is caught as soon as the trainer's weights
  have moved clear of the noise. Each judged pass moves the anchor there. Without a
  version-0 measurement (a run resumed from a checkpoint) a replica's first probe
  becomes its anchor.

What the probe cannot see is a step that moved the probe's logprobs by less than the
tolerance (exact) or the noise (moved): each check also reports `signal`, how far this
version's expected logprobs are from the previous one's, and the moved rule counts
its unseen replicas, so a record shows whether a skipped load would have been caught.

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

# The exact rule's default max |logprob diff| per engine, for float32 weights served as
# sent. Narrower dtypes take the moved rule (module docstring): no fixed bound.
PROBE_ATOL = {
    "hf": 1e-5,      # the trainer's kernels and weights: 0.0 measured (full pushes)
    "vllm": 1e-3,    # its own kernels (test_vllm.py: 1e-4; LoRA: 2.4e-5)
    "sglang": 1e-2,  # not measured here (no GPU): loose
}
# The moved rule: the share of the trainer's change a load must follow, and how many
# measured noise gaps the change must exceed before it is judged (module docstring).
MOVED_SHARE, MOVED_CLEAR = 0.5, 6.0
# A noise gap is never taken below this (L2 over the probe's 15 logprobs): float32
# rounding, so that bit-identical engines still need a change above it to be judged.
_MIN_GAP = 1e-6


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


def exact_dtypes(dtypes: tuple[str, ...]) -> bool:
    """Whether weights passing through `dtypes` (empty entries: unchanged) stay float32."""
    return all(d in ("", "float32") for d in dtypes)


def probe_atol(backend: str, lora: bool = False) -> float:
    """The exact rule's default tolerance for `backend` (float32 weights), with a LoRA
    adapter or not."""
    try:
        atol = PROBE_ATOL[str(backend)]
    except KeyError:
        raise ValueError(f"no probe tolerance for engine {backend!r}: set weights.probe_atol") from None
    return max(atol, LORA_ATOL) if lora else atol


@dataclass(frozen=True)
class ProbeRule:
    """How the driver judges a replica's probe: `atol` set, the exact rule; None, the
    moved rule with `share` and `clear` (module docstring)."""
    atol: float | None = None
    share: float = MOVED_SHARE
    clear: float = MOVED_CLEAR

    def __post_init__(self):
        if self.atol is not None and not self.atol >= 0:
            raise ValueError(f"probe tolerance must be >= 0 (got {self.atol})")
        if not 0 < self.share <= 1 or not self.clear >= 1:
            raise ValueError(f"the moved rule needs 0 < share <= 1 and clear >= 1 "
                             f"(got {self.share}, {self.clear})")

    @property
    def name(self) -> str:
        return "exact" if self.atol is not None else "moved"


def max_abs_diff(a: list[float], b: list[float]) -> float:
    """max |a - b|, NaN when any entry is NaN (`max` alone would skip it: NaN compares
    false, so `max(0.0, nan)` is 0.0)."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


def _sub(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


def _norm(a: list[float]) -> float:
    return math.sqrt(sum(x * x for x in a))


class ProbeMismatch(RuntimeError):
    """A replica's probe disagrees with the trainer's: its load did not apply."""


@dataclass(frozen=True)
class ProbeResult:
    replica_id: str
    version: int
    max_diff: float
    signal: float | None  # max |expected(v) - expected(previous)|; None for the first
    moved: float | None = None  # the moved rule's share r; None: not judged by it
    unseen: bool = False  # the moved rule could not judge: a change inside the noise


@dataclass
class _Anchor:
    """A replica's last point where its probe and the trainer's belong to the same
    weights, and its measured engine/trainer gap (L2)."""
    version: int
    engine: list[float]
    trainer: list[float]
    gap: float


class ProbeCheck:
    """The trainer's expected probe per version and each replica's verdict."""

    def __init__(self, rule: ProbeRule | float):
        self.rule = rule if isinstance(rule, ProbeRule) else ProbeRule(atol=float(rule))
        self.expected: dict[int, tuple[list[int], list[float]]] = {}
        self._previous: list[float] | None = None
        self.signal: dict[int, float | None] = {}
        self.results: dict[int, list[ProbeResult]] = {}
        # The moved rule's measurements: the trainer's probe of the model on disk, the
        # replicas' (as each registers), and each replica's anchor.
        self.base: tuple[list[int], list[float]] | None = None
        self.on_disk: dict[str, tuple[list[int], list[float]]] = {}
        self.anchors: dict[str, _Anchor] = {}

    # ---------------------------------------------------------------- measurements
    def baseline(self, ids: list[int], logprobs: list[float]) -> None:
        """The trainer's probe of the model on disk (version 0, before any step): the
        replicas that scored the same model as they registered are anchored there."""
        self.base = (list(ids), list(logprobs))
        for replica_id in list(self.on_disk):
            self._anchor_on_disk(replica_id)

    def register(self, replica_id: str, probe: tuple[list[int], list[float]] | None) -> None:
        """A replica's probe of the model on disk, scored as it registered."""
        self.anchors.pop(replica_id, None)  # a new replica under an old id starts afresh
        if probe is not None:
            self.on_disk[replica_id] = (list(probe[0]), list(probe[1]))
            self._anchor_on_disk(replica_id)

    def forget(self, replica_id: str) -> None:
        self.on_disk.pop(replica_id, None)
        self.anchors.pop(replica_id, None)

    def _anchor_on_disk(self, replica_id: str) -> None:
        ids, got = self.on_disk[replica_id]
        if self.base is None or ids != self.base[0] or len(got) != len(self.base[1]) \
                or math.isnan(max_abs_diff(got, self.base[1])):
            return
        want = self.base[1]
        self.anchors[replica_id] = _Anchor(0, got, want, _norm(_sub(got, want)))

    # ---------------------------------------------------------------- per version
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
        Raises ProbeMismatch naming the replica, the version and what was seen."""
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
        got = list(got)
        diff = max_abs_diff(got, want)
        signal = self.signal.get(version)
        if self.rule.atol is not None:
            result = self._exact(replica_id, version, diff, signal)
        else:
            result = self._moved(replica_id, version, got, want, diff, signal)
        self.results.setdefault(version, []).append(result)
        return result

    def _exact(self, replica_id: str, version: int, diff: float, signal) -> ProbeResult:
        if not diff <= self.rule.atol:  # NaN fails too
            raise ProbeMismatch(
                f"replica {replica_id} does not serve v{version}: its probe logprobs differ "
                f"from the trainer's by up to {diff:.3g} (tolerance {self.rule.atol:.3g}); the "
                f"push did not apply (a skipped load, wrong names, an ignored adapter)"
                + (f"; one step moved them by {signal:.3g}" if signal is not None else ""))
        return ProbeResult(replica_id, version, diff, signal)

    def _moved(self, replica_id: str, version: int, got: list[float], want: list[float],
               diff: float, signal) -> ProbeResult:
        if math.isnan(diff):
            raise ProbeMismatch(f"replica {replica_id} does not serve v{version}: its probe "
                                f"logprobs hold NaN")
        anchor = self.anchors.get(replica_id)
        if anchor is None:  # no version-0 measurement: this probe is the anchor
            self.anchors[replica_id] = _Anchor(version, got, want, _norm(_sub(got, want)))
            return ProbeResult(replica_id, version, diff, signal, unseen=True)
        change = _sub(want, anchor.trainer)
        size = _norm(change)
        noise = max(anchor.gap, _MIN_GAP)
        if size <= self.rule.clear * noise:  # inside the noise: cannot be judged yet
            return ProbeResult(replica_id, version, diff, signal, unseen=True)
        moved = sum(m * s for m, s in zip(_sub(got, anchor.engine), change)) / (size * size)
        if not moved >= self.rule.share:
            raise ProbeMismatch(
                f"replica {replica_id} does not serve v{version}: since v{anchor.version} the "
                f"trainer's probe logprobs moved by {size:.3g} (L2; {size / noise:.1f}x the "
                f"engine/trainer gap of {noise:.3g} measured at identical weights) and the "
                f"replica's followed {moved:.0%} of that (at least {self.rule.share:.0%} "
                f"needed): the push did not apply (a skipped load, wrong names, an ignored "
                f"adapter)")
        # The gap only grows: a load that applied most of a step keeps the rest as noise.
        self.anchors[replica_id] = _Anchor(version, got, want,
                                           max(anchor.gap, _norm(_sub(got, want))))
        return ProbeResult(replica_id, version, diff, signal, moved=moved)

    def summary(self, version: int) -> dict:
        """Step-record fields for `version`: the largest diff over its replicas, the
        signal a skipped load would have shown, and under the moved rule the smallest
        share a replica followed and how many could not be judged."""
        if version not in self.expected:
            return {}
        results = self.results.get(version, [])
        out = {"probe_max_diff": max((r.max_diff for r in results), default=None),
               "probe_signal": self.signal.get(version)}
        if self.rule.atol is None:
            out["probe_moved"] = min((r.moved for r in results if r.moved is not None),
                                     default=None)
            out["probe_unseen"] = sum(r.unseen for r in results)
        return out


# Engines that can score the probe (`InferenceEngine.score`).
PROBED_BACKENDS = ("hf", "vllm", "sglang")


def probe_enabled(cfg) -> bool:
    """Whether a run (a `Config`) probes its pushes: `weights.probe` on an engine that can."""
    return bool(cfg.weights.probe) and str(cfg.rollout.backend) in PROBED_BACKENDS


def run_probe_rule(cfg) -> ProbeRule | None:
    """The driver's probe rule for a run; None when it does not probe. An explicit
    `weights.probe_atol` is the exact rule at that tolerance; else float32 runs take the
    exact rule at the engine's default, narrower dtypes the moved rule."""
    if not probe_enabled(cfg):
        return None
    if cfg.weights.probe_atol is not None:
        return ProbeRule(atol=float(cfg.weights.probe_atol))
    if not exact_dtypes((cfg.model.dtype, cfg.weights.dtype, cfg.rollout.dtype)):
        return ProbeRule()
    return ProbeRule(atol=probe_atol(str(cfg.rollout.backend), lora=cfg.model.lora.enabled))
