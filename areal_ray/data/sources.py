"""Dataset files on disk, streamed as plain dict rows with the place each came from.

Real prompt sets come as jsonl, as parquet (a Hugging Face Hub snapshot), or as arrow
(`datasets.Dataset.save_to_disk`). Reading them here, with pyarrow only, means they
can be used as they are: no conversion step and no `datasets` dependency. A path is a
file, a directory (every data file directly in it) or a glob. Each row comes with its
place, `path:line` (jsonl, 1-based like an editor) or `path[row i]` (parquet and
arrow, 0-based like a table index), so a later check can name the exact row. Nothing
here knows what a prompt row must hold: that is `prompts.check_row`.

Files are read lazily, a record batch (or a line) at a time, and `count_rows` counts
without parsing rows (parquet footers, arrow batch headers, non-blank lines), so a
million-row dataset is never held whole by the job: the prompt stream (stream.py)
reads it in Ray Data read tasks.

A jsonl file's count is a full scan before the run, so it is also where the file's
own problems are found: a byte that is not UTF-8, a line longer than the row limit
(`task.max_row_bytes`). The scan and the reader share one idea of a line
(`jsonl_lines`): a line the reader would skip as blank (whitespace only, Unicode's
too, such as U+3000) is not counted either, or the stream would fall short of its
count mid-run.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

Located = tuple[str, object]  # (place, row as read)


class DatasetError(ValueError):
    pass


BATCH_ROWS = 8192  # rows decoded at a time from a parquet or arrow file
# A prompt row far beyond any context window is a broken file (a whole document in one
# field, a missing newline), and each one is held, parsed and shipped whole.
MAX_ROW_BYTES = 1 << 20


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def too_large(where: str, size: int, limit: int) -> DatasetError:
    return DatasetError(f"{where}: a row of {size} bytes ({_mib(size)}) is over task.max_row_bytes="
                        f"{limit} ({_mib(limit)}); shorten or drop it, or raise task.max_row_bytes")


def jsonl_lines(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of `path` that holds a row: blank ones (only
    whitespace, as `str.strip` sees it) skipped; a byte that is not UTF-8 or a line over
    `max_row_bytes` (0: no limit) is a DatasetError naming the line. Read a line at a
    time in binary, so a bad byte is named (with its offset in the file) rather than
    surfacing as a decoder's traceback."""
    offset = 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            size = len(raw.rstrip(b"\r\n"))
            if max_row_bytes and size > max_row_bytes:
                raise too_large(f"{path}:{i}", size, max_row_bytes)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"{path}:{i}: byte {raw[e.start:e.start + 1].hex(' ')} at offset {offset + e.start} "
                    f"of the file (column {e.start + 1} of the line) is not UTF-8 ({e.reason}); "
                    "re-encode the file as UTF-8") from e
            offset += len(raw)
            if text.strip():
                yield i, text


def iter_jsonl(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Located]:
    for i, line in jsonl_lines(path, max_row_bytes):
        try:
            yield f"{path}:{i}", json.loads(line.strip())  # Unicode spaces around a row too
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{i}: not valid JSON ({e.msg})") from e


def _row_sizes(batch: pa.RecordBatch) -> list[int]:
    """Bytes of each row's top-level text and binary values (what makes a row large)."""
    sizes = [0] * batch.num_rows
    for col in batch.columns:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) \
                or pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
            lengths = pc.binary_length(col).fill_null(0).to_pylist()
            sizes = [a + b for a, b in zip(sizes, lengths)]
    return sizes


def _batch_rows(path: Path, batches, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Located]:
    i = 0
    for batch in batches:
        sizes = _row_sizes(batch) if max_row_bytes else [0] * batch.num_rows
        for row, size in zip(batch.to_pylist(), sizes):
            if size > max_row_bytes:
                raise too_large(f"{path}[row {i}]", size, max_row_bytes)
            yield f"{path}[row {i}]", row
            i += 1


def _parquet(path: Path) -> pq.ParquetFile:
    try:
        # ParquetFile, not read_table: a file under a `key=value` folder must not grow
        # hive partition columns.
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: cannot read as parquet ({e})") from e


def iter_parquet(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Located]:
    try:
        yield from _batch_rows(path, _parquet(path).iter_batches(batch_size=BATCH_ROWS),
                               max_row_bytes)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: cannot read as parquet ({e})") from e


def _arrow_batches(path: Path) -> Iterator[pa.RecordBatch]:
    # save_to_disk writes the IPC stream format; plain `.arrow` files elsewhere are
    # often the random-access file format, so try both before giving up.
    try:
        with pa.memory_map(str(path)) as src:
            try:
                reader = pa.ipc.open_stream(src)
            except pa.ArrowInvalid:
                src.seek(0)
                f = pa.ipc.open_file(src)
                reader = (f.get_batch(i) for i in range(f.num_record_batches))
            yield from reader
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: cannot read as arrow ({e})") from e


def iter_arrow(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Located]:
    yield from _batch_rows(path, _arrow_batches(path), max_row_bytes)


def count_rows(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> int:
    """Rows that reading `path` yields, without parsing them; a jsonl file is scanned
    whole, so its encoding and line sizes are checked here (`jsonl_lines`)."""
    if path.suffix == ".parquet":
        return _parquet(path).metadata.num_rows
    if path.suffix == ".arrow":
        return sum(b.num_rows for b in _arrow_batches(path))
    return sum(1 for _ in jsonl_lines(path, max_row_bytes))


READERS = {".jsonl": iter_jsonl, ".parquet": iter_parquet, ".arrow": iter_arrow}
KINDS = ", ".join(READERS)


def _dir_files(path: Path) -> list[Path]:
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DatasetError(f"{path}: a saved DatasetDict with splits {splits}; "
                           f"point at one split, e.g. {path / (splits[0] if splits else 'train')}")
    # Not recursive: a Hub snapshot keeps configs and splits in subfolders, and mixing
    # train and test silently would be worse than asking for a narrower path.
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in READERS)
    if not files:
        raise DatasetError(f"{path}: no {KINDS} files directly in this directory "
                           "(for a snapshot, point at a split with a glob, e.g. "
                           f"{path}/main/train-*.parquet)")
    return files


def resolve(spec: str | Path) -> list[Path]:
    """The data files that `spec` names, in reading order."""
    path = Path(spec)
    if path.is_dir():
        return _dir_files(path)
    if path.exists():
        files = [path]
    elif any(c in str(spec) for c in "*?["):
        matches = sorted(glob.glob(str(spec), recursive=True))
        if not matches:
            raise DatasetError(f"no dataset files match {str(spec)!r}")
        files = [f for m in map(Path, matches) for f in (_dir_files(m) if m.is_dir() else [m])]
    else:
        raise DatasetError(f"dataset file not found: {path}")
    for f in files:
        if f.suffix not in READERS:
            raise DatasetError(f"{f}: unsupported file type {f.suffix or '(none)'!r}; "
                               f"expected {KINDS}, a directory or a glob")
    return files


def iter_rows(spec: str | Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[Located]:
    """Every row of every file that `spec` names, each with its place, read lazily."""
    for f in resolve(spec):
        yield from READERS[f.suffix](f, max_row_bytes)


def read_rows(spec: str | Path, max_row_bytes: int = MAX_ROW_BYTES) -> list[Located]:
    """Every row of every file that `spec` names, each with its place."""
    files = resolve(spec)
    rows = [row for f in files for row in READERS[f.suffix](f, max_row_bytes)]
    if not rows:
        where = files[0] if len(files) == 1 else f"{spec} ({len(files)} files)"
        raise DatasetError(f"{where}: no rows")
    return rows
