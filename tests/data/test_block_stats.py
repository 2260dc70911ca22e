"""Ray Data's per-block stats stay bounded over a long run (areal_ray/data/block_stats.py)."""

import pytest
from ray.data import DataContext
from ray.data._internal.execution.operators.input_data_buffer import InputDataBuffer
from ray.data._internal.execution.operators.map_operator import MapOperator
from ray.data._internal.execution.operators.map_transformer import BlockMapTransformFn, MapTransformer
from ray.data.block import BlockMetadata

from areal_ray.data import block_stats, stream  # noqa: F401  (stream installs the bound on import)

pytestmark = pytest.mark.unit


def _operator() -> MapOperator:
    ctx = DataContext.get_current()
    return MapOperator.create(MapTransformer([BlockMapTransformFn(lambda blocks, ctx: blocks)]), InputDataBuffer(ctx, input_data=[]), ctx)


def _meta(i: int) -> BlockMetadata:
    return BlockMetadata(num_rows=i, size_bytes=None, exec_stats=None, input_files=None)


def test_the_pipeline_modules_bound_every_map_operators_block_stats():
    # Ray keeps this list for the whole dataset: a run's one long dataset grew it
    # with every prompt (the coordinator's growth in benchmarks.bench_soak).
    stats = _operator().get_stats()
    (kept,) = stats.values()
    assert hasattr(kept, "maxlen"), f"unbounded: {type(kept).__name__}"
    assert kept.maxlen == block_stats.KEPT


def test_an_operator_keeps_the_newest_blocks_stats():
    op = _operator()
    for i in range(block_stats.KEPT + 10):  # as _get_next_inner records each output block
        getattr(op, block_stats._ATTR).extend([_meta(i).to_stats()])
    (kept,) = op.get_stats().values()
    assert len(kept) == block_stats.KEPT
    assert [s.num_rows for s in kept][:2] == [10, 11]


def test_install_is_idempotent_and_takes_a_new_bound():
    block_stats.install(5)
    block_stats.install(5)
    try:
        (kept,) = _operator().get_stats().values()
        assert kept.maxlen == 5
    finally:
        block_stats.install()
    (kept,) = _operator().get_stats().values()
    assert kept.maxlen == block_stats.KEPT


def test_kept_stats_pickle_as_a_plain_list():
    import pickle
    kept = block_stats.NewestBlocks([1, 2, 3], maxlen=2)
    assert kept == [2, 3]
    back = pickle.loads(pickle.dumps(kept))
    assert type(back) is list and back == [2, 3]
