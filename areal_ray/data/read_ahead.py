"""How far the prompt stream has read ahead of the rollout stage (pure, no Ray).

The stream's read tasks parse prompts far faster than rollouts use them, and Ray
Data would let them run ahead into the object store: a million-row dataset read
whole at the start, its CPU taken from the model's start-up and its rows held for
the whole run. The driver keeps this count per pipeline generation: the reader
reports the prompts it read (`read`), the rollout stage's every admission request
counts one taken (`took`), and the reader waits while more than a limit are ahead.
Taking is counted when the request arrives, before the gate decides, so prompts
waiting at the gate are taken: the reader never waits on the trainer, only on rows
it has already handed over, and cannot deadlock the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReadAhead:
    n_read: int = 0
    n_taken: int = 0
    waiting: bool = False  # a reader waits: the next take should wake it

    @property
    def ahead(self) -> int:
        return self.n_read - self.n_taken

    def read(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"read a negative count: {n}")
        self.n_read += n

    def took(self, n: int) -> bool:
        """Count `n` taken; whether a waiting reader should be woken."""
        self.n_taken += n
        wake, self.waiting = self.waiting, False
        return wake
