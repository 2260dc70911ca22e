"""The collective weight path between real processes: buckets, bit-identical receipt,
dtype conversion, and a member killed mid-broadcast turning into errors, not a hang;
its NCCL set-up through a stand-in; where shared-memory weight files go."""

import logging
import multiprocessing as mp
import os
import signal
import time
import types
from pathlib import Path

import pytest
import torch

from areal_ray.weights import group as weight_group
from areal_ray.weights import staging
from areal_ray.weights.encoding import (
    NCCL_ENV,
    SharedMemoryWeights,
    TensorSpec,
    WeightGroup,
    digest,
    free_port,
    manifest_of,
    memcpy_bandwidth,
    plan_buckets,
    read_shared,
)
from areal_ray.weights.staging import SHM_MARGIN, staging_dir


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": torch.randn(300, 101, generator=g) for i in range(12)} | {
        "bias": torch.randn(7, generator=g), "step": torch.tensor([3.0])}


def test_plan_buckets_by_hand():
    specs = [TensorSpec("a", (10,), "float32"), TensorSpec("b", (20,), "float32"),
             TensorSpec("c", (100,), "float32"), TensorSpec("d", (5,), "bfloat16"),
             TensorSpec("e", (5,), "bfloat16")]
    # 40 + 80 bytes fit in 128; c (400 bytes) gets its own; d/e change dtype -> new bucket
    assert plan_buckets(specs, 128) == [[0, 1], [2], [3, 4]]


def _member(rank, world, port, die_at, dtype, out, idle=-1, timeout_s=5.0):
    store = WeightGroup.connect("127.0.0.1", port, 10, is_master=rank == 0)
    group = WeightGroup(store, 1, rank, world, timeout_s=timeout_s)
    sd = state()
    specs = manifest_of(sd.items(), dtype)
    try:
        if rank == idle:  # joined the group, never receives (e.g. stuck loading)
            time.sleep(timeout_s + 3)
            out.put((rank, "idle", None))
        elif rank == 0:
            t0 = time.perf_counter()
            try:
                res = group.send(iter(sd.values()), specs, bucket_bytes=20_000)
            except RuntimeError as e:
                out.put((rank, "error", (str(e)[:80], time.perf_counter() - t0, group.transfers)))
                return
            out.put((rank, "sent", res["bytes"]))
        else:
            got = {}
            for k, (name, t) in enumerate(group.recv(specs, bucket_bytes=20_000)):
                if rank == die_at and k == 4:
                    os.kill(os.getpid(), signal.SIGKILL)
                got[name] = t.clone()
            out.put((rank, "got", digest(got)))
    except RuntimeError as e:
        out.put((rank, "error", str(e)[:80]))


def run_group(world, die_at=-1, dtype="", idle=-1, timeout_s=5.0):
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, die_at, dtype, out, idle, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode is not None for p in procs), "a member hung"
    results = {}
    while not out.empty():
        rank, kind, value = out.get()
        results[rank] = (kind, value)
    return results


@pytest.mark.engine  # a gloo WeightGroup between processes or threads
def test_broadcast_in_buckets_is_bit_identical_on_every_receiver():
    res = run_group(world=3)
    expected = digest(state())
    assert res[1] == ("got", expected) and res[2] == ("got", expected)
    assert res[0] == ("sent", sum(v.numel() * 4 for v in state().values()))


@pytest.mark.engine  # a gloo WeightGroup between processes or threads
def test_transfer_dtype_conversion():
    res = run_group(world=2, dtype="bfloat16")
    as_bf16 = digest({k: v.to(torch.bfloat16) for k, v in state().items()})
    assert res[1] == ("got", as_bf16)


@pytest.mark.engine  # a gloo WeightGroup between processes or threads
def test_a_member_killed_mid_broadcast_is_an_error_not_a_hang():
    res = run_group(world=3, die_at=2)
    assert 2 not in res  # killed
    assert res[0][0] == "error"  # the sender learns of it (and falls back, see train/push.py)
    # the surviving receiver either finished before the failure or gets an error
    assert res[1][0] in ("got", "error")
    if res[1][0] == "got":
        assert res[1][1] == digest(state())


@pytest.mark.engine  # a gloo WeightGroup between processes or threads
def test_a_receiver_that_never_receives_is_found_before_any_collective():
    # The sender waits for every receiver's readiness in the store, with the timeout,
    # and raises before issuing a broadcast (on NCCL a broadcast to an absent peer
    # would hang or be torn down by the watchdog, not raise).
    res = run_group(world=3, idle=2, timeout_s=2.0)
    kind, (msg, elapsed, transfers) = res[0]
    assert kind == "error" and "ranks [2] not ready" in msg and elapsed < 4
    assert transfers == 1  # counted: the next push's handshake uses fresh keys
    assert res[2] == ("idle", None)


def test_both_ends_of_an_nccl_push_get_the_same_nccl_settings():
    from areal_ray.config import load_config
    from areal_ray.run.job import trainer_runtime_env
    from deployments.rollout import build_app
    gpu = load_config("conf/gsm8k_qwen_sglang.yaml", [])
    replica = build_app(gpu, "m")._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]
    assert replica == trainer_runtime_env(gpu)["env_vars"] == NCCL_ENV
    assert NCCL_ENV["NCCL_CUMEM_ENABLE"] == "0"  # what sglang sets in its process when unset
    cpu = load_config("conf/quickstart.yaml", [])
    assert "runtime_env" not in build_app(cpu, "m")._bound_deployment.ray_actor_options
    assert trainer_runtime_env(cpu) == {}


def test_memcpy_bandwidth_is_measured():
    assert memcpy_bandwidth(1 << 20, repeats=2) > 0


# ----------------------------------------------------------------- where weight files go
@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A shared-memory dir with `free[0]` bytes free and a roomy disk dir: the free-space
    probe answers for them (a real small tmpfs needs root to mount)."""
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    disk.mkdir()
    free = {shm: 1 << 20, disk: 1 << 40}
    monkeypatch.setattr(staging, "shm_dir", lambda: shm)
    monkeypatch.setattr(staging, "disk_dir", lambda: disk)
    monkeypatch.setattr(staging, "free_bytes", lambda p: free[Path(p)])
    monkeypatch.setattr(staging, "_fell_back", set())
    return shm, disk, free


@pytest.mark.parametrize("shm_free,disk_free,nbytes,expected", [
    (1 << 30, 1 << 40, 1 << 20, "shm"),
    (SHM_MARGIN + (1 << 20), 1 << 40, 1 << 20, "shm"),  # exactly the file plus the margin
    (SHM_MARGIN + (1 << 20) - 1, 1 << 40, 1 << 20, "disk"),
    (64 << 20, 1 << 40, 3 << 30, "disk"),  # Docker's default 64 MB /dev/shm
    (64 << 20, 1 << 20, 3 << 30, OSError),  # no room anywhere: an error before any write
])
def test_staging_dir_picks_shared_memory_only_where_the_file_fits(small_shm, shm_free, disk_free,
                                                                  nbytes, expected):
    shm, disk, free = small_shm
    free.update({shm: shm_free, disk: disk_free})
    if expected is OSError:
        with pytest.raises(OSError, match="no room for a 3.00 GiB weight file"):
            staging_dir(nbytes)
    else:
        assert staging_dir(nbytes) == {"shm": shm, "disk": disk}[expected]


def test_a_shm_push_too_large_for_shared_memory_goes_to_disk_with_one_warning(small_shm, caplog):
    shm, disk, _ = small_shm
    sd = state()
    writer = SharedMemoryWeights("small")
    try:
        with caplog.at_level(logging.WARNING, logger="areal_ray.weights.encoding"):
            for _ in range(3):  # both files, then the first rewritten in place
                payload = writer.write(sd.values(), manifest_of(sd.items()))
                assert Path(payload.path).parent == disk
                assert digest(read_shared(payload)) == digest(sd)
        assert not list(shm.iterdir())
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and str(disk) in warned[0] and "--shm-size" in warned[0]
        assert "0.00 GiB free" in warned[0]  # the sizes are named
    finally:
        writer.unlink()
    assert not list(disk.iterdir())


def test_the_vllm_weight_file_goes_to_disk_when_shared_memory_is_small(small_shm):
    from safetensors.torch import load_file

    from areal_ray.rollout.engines.vllm import stage_file
    shm, disk, _ = small_shm
    sd = state()
    path = stage_file(sd)
    try:
        assert path.parent == disk and digest(load_file(str(path))) == digest(sd)
    finally:
        path.unlink()


# ----------------------------------------------------------------- NCCL set-up, without NCCL
class FakeNCCL:
    """`ProcessGroupNCCL`'s surface as WeightGroup uses it (torch's CPU build has none):
    records its options and calls, and what the store held when it connected."""

    class Options:
        def __init__(self):
            self._timeout = None
            self.config = types.SimpleNamespace(blocking=-2147483648)  # NCCL_CONFIG_UNDEF_INT

    made: list = []

    def __init__(self, store, rank, world, opts):
        self.store, self.rank, self.opts = store, rank, opts
        self.error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        self.calls, self.fail_connect = [], None
        FakeNCCL.made.append(self)

    def eager_connect_single_device(self, device):
        self.calls.append(("connect", str(device), self.store.check(["ready-0-1"])))
        if self.fail_connect:
            raise self.fail_connect

    def abort(self):
        self.calls.append(("abort",))


@pytest.fixture
def fake_nccl(monkeypatch):
    monkeypatch.setattr(weight_group.dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(weight_group.torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    FakeNCCL.made = []
    return FakeNCCL


def _nccl_group(rank, world=2, timeout_s=0.3):
    return WeightGroup(torch.distributed.HashStore(), 1, rank, world, timeout_s, backend="nccl")


def test_an_nccl_group_is_nonblocking_with_the_groups_timeout(fake_nccl):
    group = _nccl_group(0, timeout_s=7)
    pg = group.pg
    assert pg.opts.config.blocking == 0 and pg.opts._timeout.total_seconds() == 7
    assert pg.error_handling == "2" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == NCCL_ENV["TORCH_NCCL_NONBLOCKING_TIMEOUT"]
    assert pg.calls == []  # nothing connects before a push's handshake


@pytest.mark.parametrize("rank,receiver_ready,fail_connect,expected_calls,error", [
    # the sender connects once every receiver announced itself, never before
    (0, True, None, [("connect", "cuda:0", True)], None),
    (0, False, None, [("abort",)], "ranks \\[1\\] not ready"),
    # a receiver connects right after announcing itself
    (1, False, None, [("connect", "cuda:0", True)], None),
    # a set-up that fails (torch raises DistBackendError after the bound) aborts the group
    (0, True, RuntimeError("NCCL timeout in: NCCLUtils.hpp"),
     [("connect", "cuda:0", True), ("abort",)], "NCCL timeout"),
])
def test_an_nccl_communicator_is_created_right_after_the_handshake(fake_nccl, rank, receiver_ready,
                                                                   fail_connect, expected_calls,
                                                                   error):
    group = _nccl_group(rank)
    group.pg.fail_connect = fail_connect
    if receiver_ready:  # rank 1's announcements for two pushes
        for push_no in (0, 1):
            group.store.set(f"ready-{push_no}-1", "1")

    def push():
        if rank == 0:
            group.send(iter(()), [], bucket_bytes=1 << 20)
        else:
            list(group.recv([], bucket_bytes=1 << 20))

    if error:
        with pytest.raises(RuntimeError, match=error):
            push()
    else:
        push()
        push()  # the next push reuses the communicator
    assert group.pg.calls == expected_calls


def test_a_gloo_group_has_nothing_to_connect():
    store = torch.distributed.HashStore()
    group = WeightGroup(store, 1, 0, 1, timeout_s=5)
    assert group.connected and group.send(iter(()), [], 1 << 20)["bytes"] == 0


def test_the_rendezvous_store_listens_on_the_given_address_only():
    """The weight group's store is served on the node's address, not on every address
    of the node (a shared cluster's other tenants reach 0.0.0.0)."""
    import datetime

    import torch.distributed as dist

    from areal_ray.weights.group import WeightGroup
    store, port = WeightGroup.serve("127.0.0.1", 10)
    client = dist.TCPStore("127.0.0.1", port, None, False,
                           datetime.timedelta(seconds=10), wait_for_workers=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    # the kernel's table of listening sockets (state 0A): this port, on 127.0.0.1 only
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    listening = {r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port}
    assert listening == {f"0100007F:{port:04X}"}


def test_the_store_closes_its_socket_once():
    """The store owns the listening socket: dropping it closes the descriptor, and
    nothing closes that number again later (which would close whatever reused it)."""
    import gc
    import os

    from areal_ray.weights.group import WeightGroup
    store, rest = WeightGroup.serve("127.0.0.1", 10)
    del store
    gc.collect()
    r, w = os.pipe()  # takes the lowest free numbers: the store's, if it closed it
    try:
        del rest  # all that serve() returned is gone: nothing may close `r` now
        gc.collect()
        os.fstat(r)
        os.fstat(w)
    finally:
        os.close(r)
        os.close(w)
