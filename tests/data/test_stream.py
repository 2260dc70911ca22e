"""The prompt stream: order, positions, epochs and the streaming shuffle, without Ray;
then read by Ray Data on the test cluster (one row per block, exact resume skips)."""

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray.data import ActorPoolStrategy

from areal_ray.data.prompts import DatasetError
from areal_ray.data.sources import count_rows
from areal_ray.data.stream import CHECK_FIRST, file_stream, rows_stream


def write_jsonl(path, n, start=0, bad_at=None):
    lines = []
    for i in range(start, start + n):
        lines.append(json.dumps({"uid": f"u{i}", "prompt": f"{i}+0=", "answer": str(i)}
                                if i != bad_at else {"uid": f"u{i}", "prompt": "no answer"}))
        if i % 7 == 3:
            lines.append("   ")  # blank lines are not rows
    path.write_text("\n".join(lines) + "\n")
    return path


def test_count_rows_matches_what_is_read(tmp_path):
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(50)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=7)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    for name in ("a.parquet", "s.arrow", "f.arrow"):
        assert count_rows(tmp_path / name) == 50
        assert [r["answer"] for r in file_stream(str(tmp_path / name), 50, 0, 100)] != []
    assert count_rows(write_jsonl(tmp_path / "j.jsonl", 40)) == 40


def test_epochs_take_each_prompt_once_with_unique_positions(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 30)
    write_jsonl(tmp_path / "b.jsonl", 20, start=30)
    stream = file_stream(str(tmp_path), n_needed=120, seed=3, window=8)
    rows = list(stream)
    assert stream.n == 50 and stream.epochs == 3 and len(rows) == 120
    for epoch in (0, 1):
        assert sorted(r["uid"] for r in rows[50 * epoch:50 * (epoch + 1)]) == sorted(f"u{i}" for i in range(50))
        assert {r["epoch"] for r in rows[50 * epoch:50 * (epoch + 1)]} == {epoch}
    assert len({r["pos"] for r in rows}) == 120
    # a position names the row: epoch * n + its index in file order
    assert all(r["pos"] % 50 == int(r["uid"][1:]) for r in rows)
    assert [r["uid"] for r in rows[:50]] != [r["uid"] for r in rows[50:100]]  # reshuffled


def test_the_order_is_a_function_of_the_seed(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 40)
    order = lambda seed: [r["pos"] for r in file_stream(str(tmp_path), 80, seed, 16)]  # noqa: E731
    assert order(1) == order(1)
    assert order(1) != order(2)


def test_a_window_keeps_rows_near_their_place_and_shuffles_within(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 100)
    rows = list(file_stream(str(tmp_path), 100, 0, window=10))
    for k in range(0, 100, 10):
        idx = [r["pos"] for r in rows[k:k + 10]]
        assert sorted(idx) == list(range(k, k + 10))
    assert [r["pos"] for r in rows] != list(range(100))


def test_a_dataset_within_the_window_is_shuffled_whole(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 100)
    first = [r["pos"] for r in file_stream(str(tmp_path), 100, 0, window=1000)][:10]
    assert max(first) >= 20  # a window-of-10 shuffle could not bring these forward


def test_skipped_positions_are_left_out_without_moving_the_rest(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 30)
    stream = file_stream(str(tmp_path), 60, 5, 8)
    (epoch, part, take), *_ = stream.tasks()
    whole = [r["pos"] for r in stream.read(epoch, part, take)]
    skip = set(whole[::3])
    assert [r["pos"] for r in stream.read(epoch, part, take, skip)] == [p for p in whole if p not in skip]


def test_the_last_epoch_is_cut_at_what_the_run_needs(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 10)
    write_jsonl(tmp_path / "b.jsonl", 10, start=10)
    stream = file_stream(str(tmp_path), 25, 0, 4)
    assert sum(take for _, _, take in stream.tasks()) == 25
    assert len(list(stream)) == 25


def test_a_bad_row_among_the_first_fails_before_the_run(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 20, bad_at=5)
    with pytest.raises(DatasetError, match=r"a.jsonl:\d+: field 'answer' is missing"):
        file_stream(str(tmp_path), 20, 0, 8)


def test_a_bad_row_further_on_fails_when_read_naming_it(tmp_path):
    n = CHECK_FIRST + 50
    write_jsonl(tmp_path / "a.jsonl", n, bad_at=n - 2)
    stream = file_stream(str(tmp_path), n, 0, 8)  # only the first rows are checked up front
    with pytest.raises(DatasetError, match=r"a.jsonl:\d+: field 'answer' is missing"):
        list(stream)


def test_a_file_that_shrinks_during_the_run_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", 20)
    stream = file_stream(str(tmp_path), 20, 0, 8)
    write_jsonl(p, 12)
    with pytest.raises(DatasetError, match="has 12 rows, counted 20"):
        list(stream)


def test_rows_in_memory_stream_in_order():
    rows = [{"uid": str(i), "prompt": "p", "answer": "1", "verifier": "math"} for i in range(25)]
    stream = rows_stream(rows, window=10)
    assert [r["uid"] for r in stream] == [str(i) for i in range(25)]
    assert [r["pos"] for r in stream] == list(range(25))
    assert len(stream.tasks()) == 3


def test_read_tasks_carry_only_their_own_rows():
    import pickle

    from areal_ray.data.stream import PromptDatasource
    rows = [{"uid": str(i), "prompt": "p" * 100, "answer": "1", "verifier": "math"} for i in range(5000)]
    stream = rows_stream(rows, window=500)
    tasks = PromptDatasource(stream).get_read_tasks(1)
    sizes = [len(pickle.dumps(t)) for t in tasks]
    assert len(tasks) == 10 and max(sizes) < len(pickle.dumps(stream)) / 5
    positions = [r["pos"] for t in tasks for block in t() for r in block.to_pylist()]
    assert positions == list(range(5000))


# ---------------------------------------------------------------- through Ray Data

class BlockRows:
    def __call__(self, b):
        return {"rows": np.array([len(b["pos"])]), "pos": b["pos"][:1]}


def test_ray_data_reads_one_prompt_per_block_every_position_once(ray_cluster, tmp_path):
    from areal_ray.data.stream import prompt_dataset
    write_jsonl(tmp_path / "a.jsonl", 30)
    pq.write_table(pa.Table.from_pylist([{"uid": f"u{i}", "prompt": str(i), "answer": str(i)}
                                         for i in range(30, 45)]), tmp_path / "b.parquet")
    stream = file_stream(str(tmp_path), 100, 0, 8)
    # batch_size=None on an actor pool: one call per block as it comes, as in the
    # rollout stage
    per_block = prompt_dataset(stream).map_batches(
        BlockRows, batch_size=None, compute=ActorPoolStrategy(size=1), num_cpus=0)
    out = per_block.take_all()
    assert {r["rows"] for r in out} == {1}
    positions = [r["pos"] for r in out]
    assert sorted(positions) == sorted(r["pos"] for r in stream)
    assert len(positions) == 100


def test_a_resumed_stream_skips_consumed_prompts_at_the_source(ray_cluster, tmp_path):
    from areal_ray.data.stream import prompt_dataset
    from areal_ray.driver import Driver
    write_jsonl(tmp_path / "a.jsonl", 40)
    stream = file_stream(str(tmp_path), 60, 0, 8)
    consumed = [r["pos"] for r in stream][:25]
    name = f"stream-driver-{time.time_ns()}"
    driver = Driver.options(name=name).remote(eta=1, batch_groups=4)
    ray_cluster.get(driver.begin_generation.remote())
    ray_cluster.get(driver.restore.remote(0, 0, 0, consumed))
    ns = ray_cluster.get_runtime_context().namespace
    got = [r["pos"] for r in prompt_dataset(stream, name, ns).iter_rows()]
    assert sorted(got) == sorted(set(r["pos"] for r in stream) - set(consumed))
    ray_cluster.kill(driver)


def test_a_large_stream_moves_before_the_file_is_read(ray_cluster, tmp_path):
    """200k prompts with a bad row at 150k: opening checks only the first rows, and the
    first prompt leaves Ray Data although reading the whole file would fail. (Ray Data
    merges a read task's blocks up to 128 MiB by default, which would parse the whole
    file first: this test fails that way.)"""
    from areal_ray.data.stream import prompt_dataset
    p = tmp_path / "big.jsonl"
    with open(p, "w") as f:
        for i in range(200_000):
            f.write('{"prompt": "broken"}\n' if i == 150_000 else
                    f'{{"uid": "u{i}", "prompt": "{i}+1=", "answer": "{i + 1}"}}\n')
    stream = file_stream(str(p), 200_000, 0, 1000)
    rows = iter(prompt_dataset(stream).iter_rows())
    assert next(rows)["pos"] < 1000  # from the first window
    del rows
