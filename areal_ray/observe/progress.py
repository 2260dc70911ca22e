"""The console's view of training: a progress bar over `train.steps` on a terminal,
one plain line per step anywhere else.

On a terminal a tqdm bar keeps the training view to one line that updates in place,
with the step's key numbers beside it. A log is another matter: the output of a
`ray job submit` job, a notebook cell, a pipe or a CI capture is not a terminal, and
a redrawn bar turns into carriage returns and half lines there. So each step is one
plain `[areal-ray] step` line when the output is not a terminal (the line
tests/jobs/test_submit.py counts in a job's logs).

The ETA is ours on both: the mean of the last few step times times the steps left.
A rate from the start would count the first step's start-up (Ray Data, the trainer,
the first rollouts) against every step to come.

A pipeline that makes no progress (no episode starts or ends, no prompt is taken, no
step is trained) is otherwise silent: `Stall` says so once a minute (or twice the
slowest recent step, when that is longer), with what the run is waiting on, from the driver's admission counters (`Driver.gate_state`);
the dashboard's `areal_seconds_since_progress` gauge shows the same silence as it grows
(observe/metrics.py).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

RECENT = 5  # steps the ETA averages over
STALL_AFTER_S = 60.0  # silence before the console says the pipeline has stalled, and between lines
# The driver's admission counters whose change is progress: an episode admitted or
# finished, a group rejected, a step trained, a prompt read or taken.
PROGRESS_KEYS = ("started", "running", "rejected", "version", "read", "taken", "phase", "held")


def num(value, spec: str) -> str:
    """A record's number in `spec`, or "n/a": step records hold None where a value
    was not finite or not measured (train/loop.py), and a step line must still print."""
    return "n/a" if value is None else format(value, spec)


def waiting_on(state: dict) -> str:
    """What a pipeline with the admission counters `state` (`Admission.state`) waits on."""
    if state.get("held"):
        return "admissions, held until the rollout replicas are up and the eval before training is done"
    if state.get("phase") == "restoring":
        return "the trainer to restore its checkpoint"
    if state.get("running", 0) > 0:
        return (f"{state['running']} episode(s) in flight in the rollout stage (the rollout "
                "replicas; a stuck episode is abandoned at its deadline, rollout.episode_timeout_s "
                "at most)")
    in_flight = state.get("started", 0) - state.get("rejected", 0)
    allowed = (state.get("version", 0) + state.get("eta", 0) + 1) * state.get("batch_groups", 1)
    if in_flight >= allowed:
        return (f"the trainer: the staleness gate is full ({in_flight} groups admitted for version "
                f"{state.get('version', 0)}, algo.eta={state.get('eta', 0)})")
    if state.get("ahead", 0) <= 0:
        return "the prompt reader (no prompt read ahead of the rollout stage)"
    return f"the rollout stage to take one of the {state['ahead']} prompts read ahead"


class Stall:
    """Says when the pipeline has made no progress for `after_s`, and again every
    `after_s` while it stays so; pure: the caller passes the clock and the driver's
    admission counters."""

    def __init__(self, after_s: float = STALL_AFTER_S):
        self.after_s = after_s
        self._marker: tuple | None = None
        self._since = self._said = 0.0
        self._closed = False

    def quiet_s(self, now: float) -> float:
        """Seconds the counters have stood still at `now` (what the dashboard's gauge
        shows between the console's lines); 0 before the first look and once the run
        has closed."""
        return 0.0 if self._marker is None or self._closed else max(0.0, now - self._since)

    def check(self, now: float, state: dict) -> str | None:
        """The console line for `state` seen at `now`, or None."""
        marker = tuple(state.get(k) for k in PROGRESS_KEYS)
        self._closed = bool(state.get("closed"))
        if marker != self._marker:
            self._marker, self._since, self._said = marker, now, now
            return None
        if self._closed or now - self._said < self.after_s:
            return None
        self._said = now
        return (f"[areal-ray] no progress for {now - self._since:.0f} s (version "
                f"{state.get('version', 0)}, {state.get('started', 0)} episodes started, "
                f"{state.get('running', 0)} running): waiting on {waiting_on(state)}")


class StepProgress:
    def __init__(self, total_steps: int, stream: TextIO | None = None, bar: bool | None = None):
        """`bar`: None picks the bar when `stream` (stdout by default) is a terminal."""
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.done = 0  # versions trained, by this job or by those it resumed from
        self._recent_s: list[float] = []
        self._stall = Stall()
        use_bar = self.stream.isatty() if bar is None else bar
        self._bar = tqdm(total=total_steps, file=self.stream, desc="[areal-ray] step",
                         bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}",
                         dynamic_ncols=True) if use_bar else None

    def eta_s(self) -> float:
        if not self._recent_s:
            return 0.0
        return sum(self._recent_s) / len(self._recent_s) * (self.total - self.done)

    def restarted(self, version: int) -> None:
        """The trainer (re)started from the checkpoint at `version`: the count goes
        back (or, for a resumed run, forward) to it."""
        self.done = version
        self.note(f"[areal-ray] trainer (re)started from the checkpoint at version {version}")
        if self._bar is not None:
            self._bar.n = version
            self._bar.refresh()

    def step(self, rec: dict) -> None:
        """A step record arrived (`train/loop.py: step_record`)."""
        self.done += 1
        self._recent_s = (self._recent_s + [rec.get("step_s") or 0.0])[-RECENT:]
        # a run whose steps are slow is not stalled by one slow step
        self._stall.after_s = max(STALL_AFTER_S, 2 * max(self._recent_s))
        tok_s = rec["n_tokens"] / rec["step_s"] if rec.get("step_s") else 0.0
        if self._bar is None:
            print(f"[areal-ray] step {rec['step'] + 1:>4}/{self.total} v{rec['version']:<4} "
                  f"reward {num(rec['reward_mean'], '.3f')}  staleness max {rec['staleness_max']} "
                  f"mean {num(rec['staleness_mean'], '.2f')}  {tok_s:7.0f} tok/s  ETA {self.eta_s():5.0f}s",
                  file=self.stream, flush=True)
            return
        self._bar.n = self.done
        self._bar.set_postfix_str(
            f"v{rec['version']} reward {num(rec['reward_mean'], '.3f')} staleness max "
            f"{rec['staleness_max']} mean {num(rec['staleness_mean'], '.2f')} {tok_s:.0f} tok/s "
            f"ETA {self.eta_s():.0f}s", refresh=True)

    def watch(self, state: dict, now: float | None = None) -> float:
        """The driver's admission counters (`Driver.gate_state`), polled: a line when
        they have not moved for a while (`Stall`). Returns the seconds they have not
        moved (`Stall.quiet_s`)."""
        now = time.monotonic() if now is None else now
        line = self._stall.check(now, state)
        if line:
            self.note(line)
        return self._stall.quiet_s(now)

    def note(self, text: str) -> None:
        """A line of its own (above the bar, which stays at the bottom)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """The bar's final state stays on screen; later output goes below it."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
