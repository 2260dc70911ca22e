"""Dataset files of every accepted form read into the same rows; bad paths are clear errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_ray.data.sources import DatasetError, read_rows, resolve

GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 6 eggs. How many in 12 boxes?", "answer": "6 * 12 = 72\n#### 72"},
    {"question": "Half of 50?", "answer": "50 / 2 = 25\n#### 25"},
]


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved_dataset(path, rows):
    """What `datasets.Dataset.save_to_disk` leaves: an arrow IPC stream and two json files."""
    path.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (path / "dataset_info.json").write_text("{}")
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return path


def write_snapshot(root, rows):
    """A Hub snapshot's layout (openai/gsm8k): config folders holding split shards."""
    write_parquet(root / "main" / "train-00000-of-00002.parquet", rows[:2])
    write_parquet(root / "main" / "train-00001-of-00002.parquet", rows[2:])
    write_parquet(root / "main" / "test-00000-of-00001.parquet", [{"question": "held out", "answer": "#### 0"}])
    (root / "README.md").write_text("# gsm8k\n")
    return root


SOURCES = {
    "jsonl": lambda tmp: write_jsonl(tmp / "train.jsonl", GSM8K),
    "parquet": lambda tmp: write_parquet(tmp / "train.parquet", GSM8K),
    "saved_dataset_dir": lambda tmp: write_saved_dataset(tmp / "saved", GSM8K),
    "parquet_dir": lambda tmp: (write_parquet(tmp / "d" / "a.parquet", GSM8K[:1]),
                                write_jsonl(tmp / "d" / "b.jsonl", GSM8K[1:]))[0].parent,
    "snapshot_glob": lambda tmp: f"{write_snapshot(tmp / 'gsm8k', GSM8K)}/main/train-*.parquet",
    "recursive_glob": lambda tmp: f"{write_snapshot(tmp / 'gsm8k', GSM8K)}/**/train-*.parquet",
}


@pytest.mark.parametrize("kind", SOURCES)
def test_every_form_reads_the_same_rows_in_order(tmp_path, kind):
    rows = read_rows(SOURCES[kind](tmp_path))
    assert [r for _, r in rows] == GSM8K


@pytest.mark.parametrize("kind,place", [
    ("jsonl", "train.jsonl:2"),
    ("parquet", "train.parquet[row 1]"),
    ("saved_dataset_dir", "data-00000-of-00001.arrow[row 1]"),
    ("snapshot_glob", "train-00000-of-00002.parquet[row 1]"),
])
def test_each_row_names_its_file_and_row(tmp_path, kind, place):
    where, row = read_rows(SOURCES[kind](tmp_path))[1]
    assert where.endswith(place) and row == GSM8K[1]


def test_a_directory_reads_its_files_sorted_and_not_below(tmp_path):
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"n": 2}])
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"n": 1}])
    write_jsonl(tmp_path / "d" / "sub" / "c.jsonl", [{"n": 3}])
    (tmp_path / "d" / "notes.txt").write_text("not data")
    assert [p.name for p in resolve(tmp_path / "d")] == ["a.jsonl", "b.jsonl"]


def test_an_arrow_file_in_the_random_access_format_is_read_too(tmp_path):
    table = pa.Table.from_pylist(GSM8K)
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    assert [r for _, r in read_rows(tmp_path / "x.arrow")] == GSM8K


def test_nested_columns_come_back_as_lists_of_dicts(tmp_path):
    tests = [{"input": "1\n", "output": "1\n"}, {"input": "2\n", "output": "2\n"}]
    p = write_parquet(tmp_path / "code.parquet", [{"prompt": "echo", "verifier": "code", "tests": tests}])
    assert read_rows(p)[0][1]["tests"] == tests


def _bad(tmp):
    (tmp / "empty.jsonl").write_text("\n\n")
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), tmp / "empty.parquet")
    (tmp / "broken.parquet").write_bytes(b"not parquet at all")
    (tmp / "broken.arrow").write_bytes(b"not arrow at all")
    (tmp / "rows.csv").write_text("question,answer\n")
    (tmp / "bad.jsonl").write_text('{"question": "ok"}\n{"question": \n')
    (tmp / "nothing").mkdir()
    write_snapshot(tmp / "snap", GSM8K)
    (tmp / "dict" / "train").mkdir(parents=True)
    (tmp / "dict" / "test").mkdir()
    (tmp / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')


@pytest.mark.parametrize("spec,match", [
    ("missing.jsonl", "dataset file not found: .*missing.jsonl"),
    ("nowhere/train-*.parquet", "no dataset files match '.*nowhere/train-\\*.parquet'"),
    ("empty.jsonl", "empty.jsonl: no rows"),
    ("empty.parquet", "empty.parquet: no rows"),
    ("broken.parquet", "broken.parquet: cannot read as parquet"),
    ("broken.arrow", "broken.arrow: cannot read as arrow"),
    ("rows.csv", "rows.csv: unsupported file type '.csv'"),
    ("snap/*", "README.md: unsupported file type '.md'"),
    ("bad.jsonl", "bad.jsonl:2: not valid JSON"),
    ("nothing", "nothing: no .jsonl, .parquet, .arrow files directly in this directory"),
    ("snap", "snap/main/train-\\*.parquet"),
    ("dict", r"DatasetDict with splits \['test', 'train'\]; point at one split"),
])
def test_bad_paths_are_clear_errors(tmp_path, spec, match):
    _bad(tmp_path)
    with pytest.raises(DatasetError, match=match):
        read_rows(f"{tmp_path}/{spec}")
