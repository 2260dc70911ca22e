"""The run's event log: step records and restore events, read once by the job.

The trainer appends a record per step, the driver a restore event each time the
trainer (re)starts; the job process tails the log (`read(since)`) into steps.jsonl,
the console and MLflow. What the job has read it keeps itself, so the log lets it go:
the driver's memory stays flat however long the run. Indices count in the run's order,
so a reader that asks again from where it stopped sees each event once.
"""

from __future__ import annotations


class EventLog:
    def __init__(self):
        self._events: list[dict] = []  # events not yet let go
        self._base = 0  # run index of self._events[0]

    def append(self, event: dict) -> None:
        self._events.append(event)

    def read(self, since: int = 0) -> list[dict]:
        """Events from run index `since` on; those before it are let go."""
        if since > self._base:
            del self._events[:since - self._base]
            self._base = since
        return self._events[max(0, since - self._base):]
