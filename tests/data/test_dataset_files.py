"""A dataset file's own problems (its encoding, blank-looking lines, oversized rows) are
found when the job scans it, before the run, and named by file and line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_ray.config import ConfigError, load_config
from areal_ray.data.prompts import DatasetError, eval_rows, train_stream
from areal_ray.data.sources import MAX_ROW_BYTES, count_rows, iter_rows


def row(i: int, prompt: str | None = None) -> str:
    return json.dumps({"uid": f"u{i}", "prompt": prompt or f"{i}+0=", "answer": str(i)},
                      ensure_ascii=False)


def write_lines(path, lines: list[bytes | str]):
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def config(path, *keys):
    return load_config(None, [f"task.train_path={path}", f"task.eval_path={path}", *keys])


def test_a_byte_that_is_not_utf8_is_named_by_line_and_offset_before_the_run(tmp_path):
    lines = [row(i) for i in range(3000)] + [row(3000).replace("3000+0=", "3000\xff").encode("latin-1")]
    lines += [row(i) for i in range(3001, 3010)]
    p = write_lines(tmp_path / "train.jsonl", lines)
    offset = sum(len(x) + 1 for x in lines[:3000]) + lines[3000].index(b"\xff")
    # the scan before the run finds it (the stream's first rows are fine)
    with pytest.raises(DatasetError, match=rf"train.jsonl:3001: byte ff at offset {offset} of the "
                                           r"file \(column \d+ of the line\) is not UTF-8"):
        train_stream(config(p).task, 10)
    # and a reader that meets it names it too, rather than a decoder's traceback
    with pytest.raises(DatasetError, match=r"train.jsonl:3001: byte ff"):
        list(iter_rows(p))


def test_a_line_of_unicode_whitespace_is_neither_counted_nor_read(tmp_path):
    """U+3000 (ideographic space) and friends are blank to the reader: the scan must not
    count them, or the stream falls short of its count mid-run."""
    lines = [row(0), "\u3000", row(1), "\u00a0\u2003 \t", row(2), "", row(3)]
    p = write_lines(tmp_path / "train.jsonl", lines)
    assert count_rows(p) == 4 == len(list(iter_rows(p)))
    stream = train_stream(config(p).task, 8)
    assert stream.n == 4
    assert sorted(r["uid"] for r in stream) == sorted([f"u{i}" for i in range(4)] * 2)


def test_a_line_with_text_and_unicode_whitespace_is_a_row(tmp_path):
    p = write_lines(tmp_path / "train.jsonl", [row(0), "\u3000" + row(1)])
    assert count_rows(p) == 2 == len(list(iter_rows(p)))


def test_a_row_over_task_max_row_bytes_is_refused_naming_file_and_line(tmp_path):
    big = "x" * (5 << 20)
    lines = [row(i) for i in range(200)] + [row(200, big)] + [row(201)]
    p = write_lines(tmp_path / "train.jsonl", lines)
    assert config(p).task.max_row_bytes == MAX_ROW_BYTES == 1 << 20
    # past the first rows the stream checks, so found by the scan before the run
    with pytest.raises(DatasetError, match=r"train.jsonl:201: a row of \d+ bytes \(5.00 MiB\) is over "
                                           r"task.max_row_bytes=1048576 \(1.00 MiB\)"):
        train_stream(config(p).task, 10)
    with pytest.raises(DatasetError, match=r"train.jsonl:201: a row of"):
        eval_rows(config(p, "task.n_eval=300").task)
    # a larger limit, or none, takes it
    assert train_stream(config(p, "task.max_row_bytes=8388608").task, 10).n == 202
    assert train_stream(config(p, "task.max_row_bytes=0").task, 10).n == 202


def test_a_parquet_row_over_the_limit_is_named_by_its_row(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "y" * 5000, "answer": "3"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"t.parquet\[row 1\]: a row of 5001 bytes"):
        list(train_stream(config(tmp_path / "t.parquet", "task.max_row_bytes=4096").task, 2))
    assert len(list(train_stream(config(tmp_path / "t.parquet").task, 2))) == 2


def test_a_negative_row_limit_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="task.max_row_bytes must be >= 0"):
        config(tmp_path / "x.jsonl", "task.max_row_bytes=-1")
