"""The collective weight path between real processes: buckets, bit-identical receipt,
dtype conversion, and a member killed mid-broadcast turning into errors, not a hang."""

import multiprocessing as mp
import os
import signal
import time

import torch

from areal_ray.weights import (
    TensorSpec,
    NCCL_ENV,
    WeightGroup,
    digest,
    free_port,
    manifest_of,
    memcpy_bandwidth,
    plan_buckets,
)


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


def _member(rank, world, port, die_at, dtype, out, idle=-1):
    store = WeightGroup.connect("127.0.0.1", port, 10, is_master=rank == 0)
    group = WeightGroup(store, 1, rank, world, timeout_s=5)
    sd = state()
    specs = manifest_of(sd.items(), dtype)
    try:
        if rank == idle:  # joined the group, never receives (e.g. stuck loading)
            time.sleep(8)
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


def run_group(world, die_at=-1, dtype="", idle=-1):
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, die_at, dtype, out, idle))
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


def test_broadcast_in_buckets_is_bit_identical_on_every_receiver():
    res = run_group(world=3)
    expected = digest(state())
    assert res[1] == ("got", expected) and res[2] == ("got", expected)
    assert res[0] == ("sent", sum(v.numel() * 4 for v in state().values()))


def test_transfer_dtype_conversion():
    res = run_group(world=2, dtype="bfloat16")
    as_bf16 = digest({k: v.to(torch.bfloat16) for k, v in state().items()})
    assert res[1] == ("got", as_bf16)


def test_a_member_killed_mid_broadcast_is_an_error_not_a_hang():
    res = run_group(world=3, die_at=2)
    assert 2 not in res  # killed
    assert res[0][0] == "error"  # the sender learns of it (and falls back, see train/push.py)
    # the surviving receiver either finished before the failure or gets an error
    assert res[1][0] in ("got", "error")
    if res[1][0] == "got":
        assert res[1][1] == digest(state())


def test_a_receiver_that_never_receives_is_found_before_any_collective():
    # The sender waits for every receiver's readiness in the store, with the timeout,
    # and raises before issuing a broadcast (on NCCL a broadcast to an absent peer
    # would hang or be torn down by the watchdog, not raise).
    res = run_group(world=3, idle=2)
    kind, (msg, elapsed, transfers) = res[0]
    assert kind == "error" and "ranks [2] not ready" in msg and elapsed < 8
    assert transfers == 1  # counted: the next push's handshake uses fresh keys
    assert res[2] == ("idle", None)


def test_both_ends_of_an_nccl_push_get_the_same_nccl_settings():
    from areal_ray.config import load_config
    from areal_ray.run import trainer_runtime_env
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
