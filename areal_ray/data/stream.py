"""The prompt stream: the order in which training sees prompts, read lazily.

A run needs `steps * batch_groups` prompts (more with the dynamic filter): the dataset
cycled epoch by epoch, each prompt once per epoch, reshuffled each epoch with
`task.seed + epoch`. `PromptStream` is that order as a list of *parts* per epoch (a
dataset file, or a slice of the embedded task's rows) whose rows are read one window
at a time, so nothing needs the whole dataset in memory: the job only resolves the
files and counts their rows, and Ray Data read tasks (`PromptDatasource`) parse the
rows while the run consumes them.

The per-epoch shuffle is a streaming one, as in any reader that cannot seek: the
order of the files is permuted, and within a file each window of
`task.shuffle_window` consecutive rows is permuted. A dataset no larger than the
window is shuffled whole, every epoch; a larger one keeps rows within a window of
their place in the file (shuffle a sorted dataset once, offline, if that matters).

With a driver, the reader stays at most `READ_AHEAD` prompts ahead of the rollout
stage (read_ahead.py), so the run holds a bounded slice of the dataset, whatever its
size, and parses it as it goes.

Every row carries its *position*, `epoch * n + index` (n rows in the dataset; index
its place in file order), unique over the run and independent of the read order. A
checkpoint stores the positions consumed; a resumed run skips them at the source,
a read task asking the driver once for those in its range (`Driver.consumed_between`),
and the staleness gate still refuses any that reach it.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Container, Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import pyarrow as pa
import ray
from ray.data import DataContext
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from areal_ray.cluster.home import on_node
from areal_ray.data import block_stats
from areal_ray.data.prompts import PLAIN, Fields, check_row
from areal_ray.data.sources import MAX_ROW_BYTES, READERS, DatasetError, count_rows, resolve

COLUMNS = ("uid", "prompt", "answer", "verifier")
SCHEMA = pa.schema([("pos", pa.int64())] + [(c, pa.string()) for c in COLUMNS])
CHECK_FIRST = 100  # rows of each file checked before the run starts
BLOCK_ROWS = 256  # rows per block read, before the split into one-row blocks
MAX_BLOCK_BYTES = 1  # the pipeline's block size target: one row per block (prompt_dataset)
# Most prompts read but not yet taken by the rollout stage. A chunk counts as read
# before it is handed over, so this must exceed BLOCK_ROWS: the reader then waits only
# while rows it has handed over (one per block, none held back) are still untaken.
READ_AHEAD = 1024
assert READ_AHEAD > BLOCK_ROWS
# Ray Data's coordinator unpickles `PromptDatasource`, so it imports this module before
# it builds the pipeline's operators: their per-block stats are bounded there (and in
# any process that runs a pipeline itself).
block_stats.install()


@dataclass(frozen=True)
class Part:
    """One read task's rows: a dataset file, or embedded rows (already checked)."""
    offset: int  # index of its first row in the dataset
    count: int
    path: str = ""
    rows: tuple[dict, ...] = ()


@dataclass(frozen=True)
class PromptStream:
    parts: tuple[Part, ...]
    n_needed: int
    seed: int = 0
    window: int = 10_000
    shuffle: bool = True
    fields: Fields = PLAIN
    max_row_bytes: int = MAX_ROW_BYTES

    @property
    def n(self) -> int:
        """Rows in the dataset (one epoch)."""
        return sum(p.count for p in self.parts)

    @property
    def epochs(self) -> int:
        return math.ceil(self.n_needed / self.n)

    def tasks(self) -> list[tuple[int, Part, int]]:
        """(epoch, part, rows to take from it) in stream order; the last epoch is cut
        at `n_needed`."""
        out, left = [], self.n_needed
        for epoch in range(self.epochs):
            parts = list(self.parts)
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}").shuffle(parts)
            for part in parts:
                take = min(part.count, left)
                if take:
                    out.append((epoch, part, take))
                left -= take
        return out

    def _located(self, part: Part) -> Iterator[tuple[int, dict]]:
        """(index in the part, checked row) in file order."""
        if part.rows:
            yield from enumerate(part.rows)
            return
        path = Path(part.path)
        for i, (where, row) in enumerate(READERS[path.suffix](path, self.max_row_bytes)):
            yield i, check_row(row, where, self.fields)

    def read(self, epoch: int, part: Part, take: int,
             skip: Container[int] = ()) -> Iterator[dict]:
        """The part's first `take` rows in this epoch's order, positions in `skip` left
        out (they still count towards `take`: the order does not depend on them)."""
        rows = self._located(part)
        base = epoch * self.n + part.offset
        for k in range(0, take, self.window):
            window = list(islice(rows, min(self.window, take - k)))
            if len(window) < min(self.window, take - k):
                raise DatasetError(f"{part.path}: has {k + len(window)} rows, counted "
                                   f"{part.count}; did it change during the run?")
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}/{part.offset}/{k}").shuffle(window)
            for i, row in window:
                if base + i not in skip:
                    yield dict(row, pos=base + i, epoch=epoch)

    def without_rows(self) -> PromptStream:
        """This stream with no embedded rows in it (each read task carries its own part's
        rows; this is what they share)."""
        return replace(self, parts=(Part(0, self.n),))

    def __iter__(self) -> Iterator[dict]:
        """The whole stream in this process (tests, and peers fed the same order)."""
        for epoch, part, take in self.tasks():
            yield from self.read(epoch, part, take)


def file_stream(spec: str, n_needed: int, seed: int, window: int,
                fields: Fields = PLAIN, max_row_bytes: int = MAX_ROW_BYTES) -> PromptStream:
    """The stream of a dataset path. Reads only row counts and the first
    `CHECK_FIRST` rows of each file, so a dataset whose rows the mapping cannot use
    fails here, naming the file and row, before Ray starts; a bad row further on
    fails the run when it is read, with the same message. A jsonl file's count scans
    every line, so its encoding and row sizes are checked whole here (sources.py)."""
    parts, offset = [], 0
    for path in resolve(spec):
        for where, row in islice(READERS[path.suffix](path, max_row_bytes), CHECK_FIRST):
            check_row(row, where, fields)
        n = count_rows(path, max_row_bytes)
        if n:
            parts.append(Part(offset, n, str(path)))
        offset += n
    if not parts:
        raise DatasetError(f"{spec}: no rows")
    return PromptStream(tuple(parts), n_needed, seed, window, True, fields, max_row_bytes)


def rows_stream(rows: list[dict], window: int = 10_000) -> PromptStream:
    """A stream of rows already in memory, in their order (the embedded task)."""
    parts = tuple(Part(k, len(rows[k:k + window]), rows=tuple(rows[k:k + window]))
                  for k in range(0, len(rows), window))
    return PromptStream(parts, len(rows), window=window, shuffle=False)


def _read_blocks(stream: PromptStream, epoch: int, part: Part, take: int,
                 driver_name: str, namespace: str, generation: int) -> Iterator[pa.Table]:
    driver, skip = None, ()
    if driver_name:
        driver = ray.get_actor(driver_name, namespace=namespace)
        lo = epoch * stream.n + part.offset
        skip = set(ray.get(driver.consumed_between.remote(lo, lo + part.count)))
    rows = stream.read(epoch, part, take, skip)
    while chunk := list(islice(rows, BLOCK_ROWS)):
        if driver is not None:  # wait while the rollout stage is far behind (read_ahead.py)
            ray.get(driver.read_ahead.remote(generation, len(chunk), READ_AHEAD))
        yield pa.Table.from_pylist([{"pos": r["pos"], **{c: str(r[c]) for c in COLUMNS}}
                                    for r in chunk], schema=SCHEMA)


class PromptDatasource(Datasource):
    """The stream as Ray Data read tasks, one per (epoch, part), in stream order.

    Not `ray.data.read_json`/`read_parquet`: positions need each row's index in file
    order and errors its place (`path:line`), which those readers do not give, and
    `read_json` infers one Arrow type per column and block, so a file whose rows
    disagree (an integer answer here, a string there) fails to read. The read tasks
    parse with `sources.py` (json per line, pyarrow for parquet and arrow)."""

    def __init__(self, stream: PromptStream, driver_name: str = "", namespace: str = "",
                 generation: int = 0):
        super().__init__()
        self.stream, self.driver_name, self.namespace = stream, driver_name, namespace
        self.generation = generation

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        shared = self.stream.without_rows()
        return [ReadTask(functools.partial(_read_blocks, shared, epoch, part, take,
                                           self.driver_name, self.namespace, self.generation),
                         BlockMetadata(num_rows=take, size_bytes=None, exec_stats=None,
                                       input_files=(part.path,) if part.path else None),
                         schema=SCHEMA, per_task_row_limit=per_task_row_limit)
                for epoch, part, take in self.stream.tasks()]


def prompt_dataset(stream: PromptStream, driver_name: str = "", namespace: str = "",
                   generation: int = 0, home: str = "") -> ray.data.Dataset:
    """The stream as a Dataset of one-row blocks `{pos, uid, prompt, answer, verifier}`.

    One row per block: a block is what the rollout stage handles in one call, and a
    row waiting in a half-done block behind the staleness gate would stall the run
    (docs/stack_facts.md). One read task at a time and no CPU reserved: parsing is
    light, and a CPU held by a reader paused by backpressure would starve the trainer
    on a small machine (a `repartition` would split blocks too, but in tasks that each
    need a CPU: with the trainers and reward actors holding every CPU it never ran).
    `home`: the node the reads run on (cluster/home.py; "": any)."""
    source = PromptDatasource(stream, driver_name, namespace, generation)
    # Ray Data merges a read task's blocks until `target_max_block_size` (128 MiB by
    # default): a million-row file would be parsed whole before its first prompt
    # moved, and a reader waiting for its rows to be taken would wait for rows held
    # in that merge. With a 1-byte target the read operator passes every row on as a
    # block of its own (it slices larger ones) and holds none back. A dataset keeps
    # the context it is created with (the stages added to it too), so the pipeline
    # gets this target and the caller's context is left as it was.
    ctx = DataContext.get_current()
    saved, ctx.target_max_block_size = ctx.target_max_block_size, MAX_BLOCK_BYTES
    try:
        ds = ray.data.read_datasource(source, num_cpus=0, concurrency=1,
                                      override_num_blocks=len(stream.tasks()),
                                      ray_remote_args=on_node(home) or None)
    finally:
        ctx.target_max_block_size = saved
    return ds
