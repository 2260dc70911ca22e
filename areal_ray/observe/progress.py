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
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

RECENT = 5  # steps the ETA averages over


def num(value, spec: str) -> str:
    """A record's number in `spec`, or "n/a": step records hold None where a value
    was not finite or not measured (train/loop.py), and a step line must still print."""
    return "n/a" if value is None else format(value, spec)


class StepProgress:
    def __init__(self, total_steps: int, stream: TextIO | None = None, bar: bool | None = None):
        """`bar`: None picks the bar when `stream` (stdout by default) is a terminal."""
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stdout
        self.done = 0  # versions trained, by this job or by those it resumed from
        self._recent_s: list[float] = []
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
