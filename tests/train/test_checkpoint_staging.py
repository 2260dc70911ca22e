"""A checkpoint is staged on the run dir's filesystem (not the temp dir), and a disk too
full for it is an ENOSPC naming the path and the bytes needed, before anything is written."""

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train

from areal_ray.train.checkpoint import (
    STAGING,
    latest_checkpoint,
    require_room,
    room_problem,
    staging_parent,
    tensor_bytes,
)
from tests.train.test_checkpoint import save, storage, trained  # noqa: F401 - a fixture


@pytest.mark.parametrize("needed, free, problem", [
    (100, 100, None),
    (100, 10**9, None),
    (3 << 30, 1 << 30, "3221225472 bytes (3.00 GiB) are needed under /runs/r/train/.staging/rank-0 "
                       "and its filesystem has 1073741824 (1.00 GiB) free"),
])
def test_room_is_checked_against_the_free_space(needed, free, problem):
    path = Path("/runs/r/train/.staging/rank-0")
    got = room_problem(path, needed, free)
    assert got == problem if problem is None else got.startswith(problem)
    if problem is None:
        require_room(path, needed, "x", free=free)
        return
    with pytest.raises(OSError) as e:
        require_room(path, needed, "the checkpoint of version 4 (rank 0)", free=free)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    assert "no room for the checkpoint of version 4 (rank 0): 3221225472 bytes" in str(e.value)


def test_staging_goes_beside_local_storage_only(tmp_path):
    assert staging_parent(str(tmp_path)) == tmp_path / STAGING
    assert staging_parent(str(tmp_path / "missing")) is None  # storage not on this node
    assert staging_parent("s3://bucket/runs/r/train") is None
    assert staging_parent("bucket/runs/r/train") is None  # a remote filesystem's path
    assert staging_parent(None) is None


def test_tensor_bytes_counts_nested_state():
    import torch
    state = {"a": {"model": {"w": torch.zeros(4, 3)}, "optim": {"state": [torch.zeros(2, dtype=torch.bfloat16)]}},
             "step": 3}
    assert tensor_bytes(state) == 4 * 3 * 4 + 2 * 2


def test_a_checkpoint_is_staged_on_the_run_dirs_filesystem(random_model_dir, one_rank_group,
                                                           storage, monkeypatch):  # noqa: F811
    """Ray Train's context (an outside engine) names the storage; what it is handed to
    copy lies under it, and nothing staged is left once the save returns."""
    storage.root.mkdir(parents=True)
    seen = []
    report = storage.report
    monkeypatch.setattr(ray.train, "report", lambda metrics, checkpoint=None: (
        seen.append(Path(checkpoint.path)), report(metrics, checkpoint)))
    monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(
        get_storage=lambda: SimpleNamespace(experiment_fs_path=str(storage.root))))
    save(trained(random_model_dir), 1)
    assert seen == [storage.root / STAGING / "rank-0"]
    assert latest_checkpoint(storage.root) is not None
    assert not seen[0].exists()  # the staged copy is gone, the stored one kept


def test_a_full_disk_is_recognised_through_the_layers_that_wrap_it():
    """DCP and Ray Train re-raise a writer's ENOSPC inside their own errors: the save
    still turns it into one naming the path and the bytes needed."""
    from areal_ray.train.checkpoint import _is_enospc
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("a rank failed to write its shards") from inner
    except RuntimeError as outer:
        assert _is_enospc(outer)
    assert _is_enospc(RuntimeError("[Errno 28] No space left on device: '/x'"))
    assert not _is_enospc(RuntimeError("something else")) and not _is_enospc(None)
