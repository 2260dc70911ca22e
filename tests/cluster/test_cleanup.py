"""The sweep on a live cluster (areal_ray/cluster/cleanup.py): a trainer's restart removes
its own job's files of dead writers, never another live job's, and a dry run removes
nothing. The rules are table-tested in test_ownership.py; a killed job's clean-up end to
end in tests/jobs/test_cleanup.py."""

import os

from areal_ray.cluster import cleanup
from areal_ray.cluster.ownership import Owned

ME, OTHER, DEAD = Owned("feedf00d"), Owned("0123abcd"), Owned("deadbeef")
GONE = 2 ** 22 + 12345  # above the default pid_max: no process has it


def test_sweep_local_files(ray_cluster, tmp_path, monkeypatch):
    @ray_cluster.remote(num_cpus=0)
    class Holder:
        pass

    drivers = [Holder.options(name=o.driver_name).remote() for o in (ME, OTHER)]
    ray_cluster.get([d.__ray_ready__.remote() for d in drivers])
    monkeypatch.setattr(cleanup, "weight_dirs", lambda: [tmp_path])
    files = {
        ME.weight_file("weights", os.getpid(), "0.bin"): False,    # this trainer's
        ME.weight_file("weights", GONE, "0.bin"): True,            # the incarnation before
        OTHER.weight_file("weights", GONE, "0.bin"): False,        # a live job's: its own business
        DEAD.weight_file("vllm", os.getpid(), "x.safetensors"): True,  # a dead job's
        "areal-weights-5f3a9c01be77-0.bin": False,                 # unowned
    }
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    try:
        stale = sorted(str(tmp_path / n) for n, gone in files.items() if gone)
        assert cleanup.sweep_local_files(dry_run=True, own_tag=ME.tag) == stale
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
        assert cleanup.sweep_local_files(dry_run=False, own_tag=ME.tag) == stale
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, g in files.items() if not g)
    finally:
        for d in drivers:
            ray_cluster.kill(d)
