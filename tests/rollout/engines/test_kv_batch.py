"""KVBatch and GrowingLayer: in-place growth, left-padded merges, trimming on keep."""

import torch

from areal_ray.rollout.engines.kv_batch import GrowingLayer, KVBatch, new_cache


def kv(rows: int, width: int, fill: float):
    return torch.full((rows, 2, width, 4), fill)


def prefilled(rows: int, width: int, fill: float, real: list[int]) -> KVBatch:
    cache = new_cache(2)
    for layer in cache.layers:
        layer.update(kv(rows, width, fill), kv(rows, width, fill))
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, n in enumerate(real):
        mask[i, width - n:] = 1
    return KVBatch(cache, mask, [f"r{fill}-{i}" for i in range(rows)])


def test_growing_layer_appends_in_place_within_its_capacity():
    layer = GrowingLayer()
    layer.update(kv(3, 5, 1.0), kv(3, 5, 1.0))
    ptr = layer.keys.data_ptr()
    for step in range(10):
        keys, _ = layer.update(kv(3, 1, 2.0 + step), kv(3, 1, 2.0 + step))
        assert keys.data_ptr() == ptr  # no copy of the cache per step
    assert layer.get_seq_length() == 15 and keys[0, 0, -1, 0] == 11.0
    layer.keys = layer.keys[:2].clone()  # replaced from outside (a row selection)
    layer.values = layer.values[:2].clone()
    keys, _ = layer.update(kv(2, 1, 20.0), kv(2, 1, 20.0))
    assert keys.shape == (2, 2, 16, 4) and keys[1, 0, -1, 0] == 20.0 and keys[1, 0, 0, 0] == 1.0


def test_merge_pads_the_narrower_batch_on_the_left_and_keep_trims():
    a = prefilled(2, 6, 1.0, real=[6, 3])
    b = prefilled(1, 2, 2.0, real=[2])
    a.merge(b)
    assert a.size == 3 and a.width == 6 and a.rows == ["r1.0-0", "r1.0-1", "r2.0-0"]
    assert a.mask[2].tolist() == [0, 0, 0, 0, 1, 1]
    assert a.cache.layers[0].keys[2, 0, :4].abs().sum() == 0  # padding
    assert a.positions().flatten().tolist() == [6, 3, 2]
    a.keep([1, 2])  # the only row using the first three columns leaves
    assert a.width == 3 and a.rows == ["r1.0-1", "r2.0-0"]
    assert a.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert a.cache.layers[1].keys.shape == (2, 2, 3, 4)
    a.keep([])
    assert a.size == 0 and a.rows == []


def test_truncate_undoes_a_step_that_failed_half_way_and_growth_stays_in_place():
    a = prefilled(2, 4, 1.0, real=[4, 2])
    a.cache.layers[0].update(kv(2, 1, 5.0), kv(2, 1, 5.0))  # grown before a later layer raised
    a.step_mask()
    a.truncate(4)
    assert a.width == 4 and a.positions().flatten().tolist() == [4, 2]
    assert [layer.keys.shape[-2] for layer in a.cache.layers] == [4, 4]
    ptr = a.cache.layers[0].keys.data_ptr()
    a.step_mask()
    for layer in a.cache.layers:  # the retried step appends where the failed one did
        layer.update(kv(2, 1, 6.0), kv(2, 1, 6.0))
    assert a.cache.layers[0].keys.data_ptr() == ptr and a.width == 5
    assert a.cache.layers[0].keys[:, 0, -1, 0].tolist() == [6.0, 6.0]


def test_split_gives_each_live_row_its_own_trimmed_cache_and_leaves_the_batch_alone():
    a = prefilled(3, 5, 1.0, real=[5, 2, 3])
    for layer in a.cache.layers:
        layer.keys = layer.keys + torch.arange(3.0)[:, None, None, None]  # row i holds 1 + i
    a.rows[1] = None  # finished, not compacted yet
    parts = a.split()
    assert [p.rows for p in parts] == [["r1.0-0"], ["r1.0-2"]]
    assert [p.mask.tolist() for p in parts] == [[[1] * 5], [[1] * 3]]
    assert [p.positions().item() for p in parts] == [5, 3]
    assert parts[1].cache.layers[1].keys.shape == (1, 2, 3, 4)
    assert parts[1].cache.layers[1].keys.unique().tolist() == [3.0]
    for layer in parts[1].cache.layers:  # a part grows on its own
        layer.update(kv(1, 1, 9.0), kv(1, 1, 9.0))
    assert parts[1].cache.layers[0].keys.shape[-2] == 4
    assert a.size == 3 and a.cache.layers[0].keys.shape == (3, 2, 5, 4)
