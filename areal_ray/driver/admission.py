"""Admission: which prompt group may start generating now, as an explicit state machine.

The rollout stage asks before each prompt group; the answer depends on four things that
used to be flags on the driver actor: the staleness gate (data/staleness.py), the
pipeline *generation* the caller belongs to, the run's *phase*, and the prompt positions
consumed before the checkpoint the trainer restored. This class owns all four and
answers synchronously; the driver actor only waits on a condition variable and asks
again when something changed. So every rule here is reachable by a unit test without
Ray, and the restart protocol is a table instead of a docstring:

    RUNNING   --begin_generation-->  RESTORING   (a new pipeline: the old one's calls
                                                  become no-ops; admissions wait)
    RESTORING --restore-->           RESTORING   (gate reset to the checkpoint; the
                                                  trainer's weights are being published)
    RESTORING --resume-->            RUNNING     (every replica serves them: admit)
    RUNNING | RESTORING --close-->   CLOSED      (end of training; terminal: a closed
                                                  run admits nothing, whatever follows)

A driver starts RUNNING at generation 0, so a caller that never builds pipelines (a
benchmark, a test) is admitted at once; Ray Train's pipeline factory always opens a
generation first (`begin_generation`), and the trainer's `restore` + `resume` follow.

Orthogonal to the phase, admissions can be *held* from the start until `release()`:
a job starts its trainer and pipeline while the replicas start and the initial weights
are evaluated (run/startup.py), and no prompt may be generated, nor any version
trained, before that evaluation has read the weights it measures.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from areal_ray.data.read_ahead import ReadAhead
from areal_ray.data.staleness import StalenessGate


class Phase(enum.Enum):
    RUNNING = "running"
    RESTORING = "restoring"
    CLOSED = "closed"


class Wait:
    """The caller must wait and ask again after the next change."""

    def __repr__(self) -> str:
        return "WAIT"

    def __reduce__(self):
        # Unpickled as the module's one instance: Ray ships the actor class by value,
        # with a copy of each global it uses, and callers test `is WAIT`.
        return "WAIT"


WAIT = Wait()


@dataclass(frozen=True)
class Admitted:
    ticket: int
    version: int  # the gate's version at admission: the sample's staleness base


class Admission:
    def __init__(self, gate: StalenessGate, ordered: bool = False, held: bool = False):
        """`ordered`: admit prompts strictly in stream order (`run.deterministic`), so
        ticket k always goes to the same prompt and a step trains the same groups in
        every run; otherwise in arrival order, which concurrency makes vary. `held`:
        admit nothing until `release()`."""
        self.gate = gate
        self.ordered = ordered
        self.held = held
        self.next_position = 0  # ordered: the next stream position to admit
        self.phase = Phase.RUNNING
        self.generation = 0
        self.consumed: set[int] = set()  # prompt positions trained or rejected before the restore
        self.reader = ReadAhead()  # the prompt stream's lead over the rollout stage

    # ------------------------------------------------------------ the rollout stage
    def arrive(self, generation: int) -> bool:
        """A prompt reached the rollout stage: it counts as taken from the reader before
        the gate decides, so the reader never waits on the trainer. Returns whether a
        waiting reader should be woken."""
        return generation == self.generation and self.reader.took(1)

    def decide(self, position: int, generation: int) -> Admitted | Wait | None:
        """None: skip this prompt for good (the run is closed, the caller's pipeline is
        an old one, or the position was consumed before the restore)."""
        if (self.phase is Phase.CLOSED or generation != self.generation
                or position in self.consumed):
            return None
        if self.phase is Phase.RESTORING or self.held:
            return WAIT
        if self.ordered and position > self.next_position:
            return WAIT  # an earlier prompt is still on its way to the gate
        ticket = self.gate.try_acquire()
        if ticket is None:
            return WAIT
        if self.ordered and position == self.next_position:
            self._advance()
        return Admitted(ticket, self.gate.state.version)

    def _advance(self) -> None:
        self.next_position += 1
        while self.next_position in self.consumed:  # the source skips these
            self.next_position += 1

    def finish(self, generation: int) -> bool:
        """A group of `generation` is generated; False (nothing changed) for an old one."""
        if generation != self.generation:
            return False
        self.gate.finish()
        return True

    def reject(self, n: int) -> None:
        """The trainer's dynamic filter dropped n delivered groups: their slots free up."""
        self.gate.reject(n)

    def served(self, version: int) -> None:
        """Every live replica serves `version`: the staleness bound moves on."""
        self.gate.set_version(version)

    # ------------------------------------------------------------ the prompt reader
    def read(self, generation: int, n: int) -> bool:
        """The stream read n prompts; False for an old pipeline's reader (ignored)."""
        if generation != self.generation:
            return False
        self.reader.read(n)
        return True

    def reader_waits(self, generation: int, limit: int) -> bool:
        """Whether a reader of `generation` is more than `limit` prompts ahead."""
        waits = (self.phase is not Phase.CLOSED and generation == self.generation
                 and self.reader.ahead > limit)
        if waits:
            self.reader.waiting = True
        return waits

    def consumed_between(self, lo: int, hi: int) -> list[int] | Wait:
        """Consumed positions in [lo, hi), once the restore has told them."""
        if self.phase is Phase.RESTORING:
            return WAIT
        return sorted(p for p in self.consumed if lo <= p < hi)

    # ------------------------------------------------------------ lifecycle
    def begin_generation(self) -> int:
        """A new pipeline is being built: the running groups of the old one are
        abandoned (the restore resets the gate), and admissions wait for it."""
        self.generation += 1
        self.reader = ReadAhead()
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.RESTORING
        return self.generation

    def restore(self, version: int, next_ticket: int, rejected: int, consumed=()) -> None:
        """The trainer's starting point (version 0, or a checkpoint's)."""
        if self.phase is Phase.CLOSED:
            return
        self.gate.restore(version, next_ticket, rejected)
        self.consumed = set(consumed)
        self.next_position = -1  # the restarted stream begins at its first unconsumed row
        self._advance()
        self.phase = Phase.RESTORING

    def resume(self) -> None:
        """The restored weights are served: admissions go on."""
        if self.phase is Phase.RESTORING:
            self.phase = Phase.RUNNING

    def release(self) -> bool:
        """The job no longer holds admissions; whether that changed anything."""
        changed, self.held = self.held, False
        return changed

    def close(self) -> None:
        self.gate.close()
        self.phase = Phase.CLOSED

    def state(self) -> dict:
        return {**self.gate.state_dict(), "eta": self.gate.eta,
                "batch_groups": self.gate.batch_groups,
                "max_concurrent": self.gate.max_concurrent,
                "phase": self.phase.value, "held": self.held, "generation": self.generation,
                "read": self.reader.n_read, "taken": self.reader.n_taken,
                "ahead": self.reader.ahead}
