"""Ray Data's per-block stats, bounded to the newest blocks of each operator.

Every Ray Data map operator (Ray 2.60, `MapOperator._get_next_inner`) appends a
`BlockStats` for every block it outputs to a list it keeps until the dataset is
dropped, and nothing in `DataContext` turns that off. Ray uses the list only for the
summary `Dataset.stats()` prints. A run streams one dataset for its whole length, one
prompt per block (stream.py), through three operators, so that list grows the Ray
Data coordinator (`SplitCoordinator`) with the steps: about 1.9 KiB per block and
operator (measured: docs/architecture.md, "Long runs").

`install()` makes each map operator keep the stats of its newest `KEPT` blocks: the
summary then describes the run's recent blocks instead of all of them, and memory no
longer grows with the run. It wraps the operator's constructor, since the list is
created there and only ever extended; it must run in the process that executes the
dataset, the coordinator, which imports this package when it unpickles the prompt
datasource (stream.py installs it on import). Idempotent.
"""

from __future__ import annotations

import functools

from ray.data._internal.execution.operators.map_operator import MapOperator

KEPT = 1000  # blocks of stats each operator keeps
_ATTR = "_output_blocks_stats"  # the list, in Ray 2.60's MapOperator.__init__


class NewestBlocks(list):
    """A list of block stats that keeps its newest `maxlen` on `extend` (what the
    operator calls). Not a deque: a dataset iterated in the process that executes it
    pickles its stats, these lists included, while the executor's thread extends them
    (Ray's iteration metrics), and a deque refuses to be iterated while it changes. It
    pickles as a plain list, so the process that unpickles it needs nothing of ours."""

    def __init__(self, items=(), maxlen: int = KEPT):
        super().__init__(items)
        self.maxlen = maxlen
        del self[:-maxlen]

    def extend(self, items) -> None:
        super().extend(items)
        if len(self) > self.maxlen:
            del self[:len(self) - self.maxlen]

    def __reduce__(self):
        return list, (list(self),)


def install(kept: int = KEPT) -> None:
    """Bound the block stats of every MapOperator created from now on to `kept`."""
    init = MapOperator.__init__
    if getattr(init, "_areal_kept", None) == kept:
        return
    original = getattr(init, "__wrapped__", init)

    @functools.wraps(original)
    def bounded_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # A Ray that renamed the list would grow again without this failing: the
        # unit test (tests/data/test_block_stats.py) checks the name on a real operator.
        if isinstance(getattr(self, _ATTR, None), list):
            setattr(self, _ATTR, NewestBlocks(getattr(self, _ATTR), kept))

    bounded_init._areal_kept = kept
    MapOperator.__init__ = bounded_init
