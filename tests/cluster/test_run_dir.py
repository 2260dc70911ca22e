"""The run dir is Ray Train's storage path (areal_ray/cluster/placement.py,
`check_run_dir`): when the job and its trainer workers may be on more than one node it
must be storage all of them mount, or the run fails at its first checkpoint. Decided
from `ray.nodes()` entries, this node's mount table and run.shared_storage."""

import pytest

from areal_ray.cluster.placement import (
    LATER_NODE,
    check_run_dir,
    mount_fstype,
    run_dir_problem,
    run_hosts,
)
from areal_ray.cluster.plan import TRAINER, Demand
from areal_ray.cluster.roles import NodeRequirement
from areal_ray.config import ConfigError, load_config

MOUNTS = "\n".join([
    "overlay / overlay rw,relatime 0 0",
    "proc /proc proc rw,nosuid 0 0",
    "/dev/nvme0n1p1 /scratch ext4 rw 0 0",
    "fs1:/export /mnt/shared nfs4 rw,vers=4.2 0 0",
    "/dev/sdb1 /mnt/shared/local xfs rw 0 0",  # a local disk mounted inside the share
    "s3fs /mnt/bucket fuse.s3fs rw 0 0",
    "fs2@tcp:/lustre /mnt/my\\040lustre lustre rw 0 0",  # a space, as the kernel writes it
    "tmpfs /mnt/shared/tmp tmpfs rw 0 0",
    "fs3:/other /mnt/shared/tmp nfs rw 0 0",  # mounted over the tmpfs: the later line holds
])


@pytest.mark.parametrize("path, fstype", [
    ("/", "overlay"),
    ("/home/me/runs/x", "overlay"),
    ("/scratch/runs", "ext4"),
    ("/scratchy/runs", "overlay"),  # a mount point is a whole path component
    ("/mnt/shared", "nfs4"),
    ("/mnt/shared/runs/gsm8k", "nfs4"),
    ("/mnt/shared/local/runs", "xfs"),
    ("/mnt/bucket/runs", "fuse.s3fs"),
    ("/mnt/my lustre/runs", "lustre"),
    ("/mnt/shared/tmp/runs", "nfs"),
])
def test_the_filesystem_of_a_path_is_its_deepest_mount(path, fstype):
    assert mount_fstype(path, MOUNTS) == fstype


def test_no_mount_table_leaves_the_type_unknown():
    assert mount_fstype("/runs", "") == ""


def node(i: int, cpus: float = 16, gpus: float = 0, alive: bool = True) -> dict:
    """A node as `ray.nodes()` lists it (the keys the check reads)."""
    return {"NodeID": f"{i:02d}" * 28, "Alive": alive, "NodeManagerAddress": f"10.0.0.{i}",
            "Resources": {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}}


HEAD = "01" * 28


@pytest.mark.parametrize("nodes, cpus, gpus, hosts", [
    # one node: the job, the controller and the workers share its disk
    ([node(1, gpus=1)], 4, 0.5, ["10.0.0.1"]),
    ([node(1)], 1, 0, ["10.0.0.1"]),
    # docs/gpu.md's two nodes of 4 GPUs: workers on either, the job on the head
    ([node(1, gpus=4), node(2, gpus=4)], 4, 1, ["10.0.0.1", "10.0.0.2"]),
    # a head without GPUs: the workers are all on the other node, the controller is not
    ([node(1, cpus=8), node(2, gpus=1)], 4, 1, ["10.0.0.1", "10.0.0.2"]),
    # a node without the resources of one worker, or a dead one, takes none
    ([node(1, gpus=1), node(2, cpus=2, gpus=1), node(3, gpus=1, alive=False)], 4, 1, ["10.0.0.1"]),
    # CPU trainers: any node with the CPUs
    ([node(1, cpus=8), node(2, cpus=8)], 4, 0, ["10.0.0.1", "10.0.0.2"]),
    # nothing can host a worker now: an autoscaler's node will
    ([node(1, cpus=8)], 4, 1, ["10.0.0.1", LATER_NODE]),
])
def test_the_nodes_that_use_the_run_dir(nodes, cpus, gpus, hosts):
    assert run_hosts(nodes, HEAD, Demand(TRAINER, cpus, gpus, 1)) == hosts


def test_a_trainer_pinned_to_a_node_type_uses_only_nodes_of_it():
    nodes = [node(1, gpus=4), {**node(2, gpus=4), "Labels": {"pool": "train"}}]
    pinned = Demand(TRAINER, 4, 1, 1, NodeRequirement(labels={"pool": "train"}))
    assert run_hosts(nodes, HEAD, pinned) == ["10.0.0.1", "10.0.0.2"]
    assert run_hosts(nodes, "02" * 28, pinned) == ["10.0.0.2"]  # the job on the train node


@pytest.mark.parametrize("hosts, fstype, shared, refused", [
    (["a"], "overlay", None, False),  # one node: any directory
    (["a"], "ext4", False, False),
    (["a", "b"], "overlay", None, True),  # two: only storage both mount
    (["a", "b"], "ext4", None, True),
    (["a", "b"], "", None, True),  # type unknown
    (["a", LATER_NODE], "xfs", None, True),
    (["a", "b"], "nfs4", None, False),
    (["a", "b"], "lustre", None, False),
    (["a", "b"], "fuse.gcsfuse", None, False),
    (["a", "b"], "fuse.sshfs", None, True),  # not known to be shared
    (["a", "b"], "fuse.sshfs", True, False),  # ...unless the config says so
    (["a", "b"], "nfs4", False, True),  # and the config's word holds both ways
])
def test_a_run_dir_on_one_nodes_disk_is_refused_when_the_run_spans_nodes(hosts, fstype, shared, refused):
    why = run_dir_problem("/runs/x", fstype, hosts, shared)
    assert (why is not None) == refused, why
    if refused:
        assert "/runs/x" in why and f"{len(hosts)} nodes" in why and "first checkpoint" in why
        assert "run.run_dir=<a directory every node mounts" in why and "run.shared_storage=true" in why


def test_check_run_dir_reads_the_cluster_and_the_mounts():
    two = [node(1, gpus=4), node(2, gpus=4)]
    cfg = load_config("conf/gsm8k_qwen_sglang.yaml")
    with pytest.raises(ConfigError, match=r"/scratch/runs/x is this node's own storage \(ext4 "
                                          r"filesystem.*2 nodes \(10.0.0.1, 10.0.0.2\)"):
        check_run_dir(cfg, "/scratch/runs/x", two, HEAD, MOUNTS)
    check_run_dir(cfg, "/mnt/shared/runs/x", two, HEAD, MOUNTS)
    check_run_dir(cfg, "/scratch/runs/x", two[:1], HEAD, MOUNTS)
    check_run_dir(load_config("conf/gsm8k_qwen_sglang.yaml", ["run.shared_storage=true"]),
                  "/scratch/runs/x", two, HEAD, MOUNTS)
    with pytest.raises(ConfigError, match="run.shared_storage=false"):
        check_run_dir(load_config("conf/gsm8k_qwen_sglang.yaml", ["run.shared_storage=false"]),
                      "/mnt/shared/runs/x", two, HEAD, MOUNTS)


def test_a_uri_run_dir_is_refused():
    # the job and rank 0 use the run dir as files: a URI would become a local directory
    # named after its scheme
    with pytest.raises(ConfigError, match="run.run_dir=s3://bucket/runs is a URI.*mount it"):
        load_config("conf/quickstart.yaml", ["run.run_dir=s3://bucket/runs"])
