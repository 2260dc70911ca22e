"""Benchmark: weight-push bandwidth on every path, against this machine's memcpy.

    python -m benchmarks.bench_weights [out=runs/bench_weights.json] [params=100e6,500e6]
                                 [replicas=1,2] [bucket_mb=256] [paths=collective,object_store,disk]

For each model size (fp32 tensors of 4M elements, like transformer layers) and
replica count, trainer-side process (this one) pushes to Ray actors standing in for
rollout replicas; each receiver loads every tensor into its own preallocated copy of
the model (the load an engine does), so a push counts from the first byte sent to the
last receiver's load. Paths, as in `areal_ray.weights.encoding`:

* collective: a standalone gloo group, flat buckets of `bucket_mb`, the next bucket
  filled while the previous is on the wire, receivers copying out while the next
  arrives;
* object_store: one `ray.put`, every receiver `ray.get`s and loads;
* disk: one safetensors file, every receiver loads it;
* shm: rank 0 writes a shared-memory file in place, every receiver maps it and loads.

Reports bytes/s per replica (model bytes / push time) and its ratio to the memcpy
bandwidth measured in the same run (one 256 MB tensor copy, best of 5). Writes JSON
and one summary line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from areal_ray.config import opt
from areal_ray.weights.encoding import (
    SharedMemoryWeights,
    WeightGroup,
    free_port,
    manifest_of,
    memcpy_bandwidth,
    put_state,
)
from areal_ray.weights.payloads import CollectivePayload, DiskPayload
from areal_ray.weights.receivers import WeightReceiver
from jobs.cli import job_config

ELEMS_PER_TENSOR = 4_000_000


def make_state(n_params: int) -> dict[str, torch.Tensor]:
    n = max(1, round(n_params / ELEMS_PER_TENSOR))
    return {f"layers.{i}.weight": torch.full((ELEMS_PER_TENSOR,), float(i)) for i in range(n)}


@ray.remote(num_cpus=0)
class Receiver:
    """A stand-in replica: the real WeightReceiver, loading into preallocated params."""

    def __init__(self, name: str, specs, timeout_s: float):
        self.receiver = WeightReceiver(name, timeout_s)
        self.params = {s.name: torch.empty(s.shape) for s in specs}

    async def load(self, payload) -> dict:
        t0 = time.perf_counter()
        for k, v in (await self.receiver.receive(payload)).items():
            self.params[k].copy_(v)
        ok = all(float(self.params[k][0]) == float(i) for i, k in enumerate(self.params))
        return {"load_s": time.perf_counter() - t0, "ok": ok}


def push_once(path: str, state: dict, receivers: list, group: dict, bucket_bytes: int,
              tmp: Path) -> dict:
    """One push, timed from the first byte sent to the last receiver's load."""
    specs = manifest_of(state.items())
    t0 = time.perf_counter()
    if path == "collective":
        payload = CollectivePayload(group["epoch"], group["addr"],
                                    {f"r{i}": i + 1 for i in range(len(receivers))},
                                    len(receivers) + 1, tuple(specs), bucket_bytes)
        refs = [r.load.remote(payload) for r in receivers]
        if group.get("group") is None:  # formed once per membership (first, warm-up push)
            group["group"] = WeightGroup(group["store"], group["epoch"], 0, len(receivers) + 1,
                                         group["timeout_s"])
        group["group"].send(iter(state.values()), specs, bucket_bytes)
    elif path == "object_store":
        payload = put_state(state)
        refs = [r.load.remote(payload) for r in receivers]
    elif path == "shm":
        if group.get("shm") is None:
            group["shm"] = SharedMemoryWeights(f"bench-{os.getpid()}")
        payload = group["shm"].write(state.values(), specs)
        refs = [r.load.remote(payload) for r in receivers]
    else:
        from safetensors.torch import save_file
        file = tmp / "weights.safetensors"
        save_file(state, str(file))
        refs = [r.load.remote(DiskPayload(str(file))) for r in receivers]
    results = ray.get(refs)
    wall = time.perf_counter() - t0
    if not all(r["ok"] for r in results):
        raise RuntimeError(f"{path}: a receiver loaded wrong weights")
    return {"push_s": wall, "load_s": max(r["load_s"] for r in results)}


def measure(path: str, n_params: float, n_replicas: int, bucket_mb: int, store, addr,
            epoch: int, tmp: Path, timeout_s: float = 300.0) -> dict:
    state = make_state(int(n_params))
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    specs = manifest_of(state.items())
    receivers = [Receiver.remote(f"r{i}", specs, timeout_s) for i in range(n_replicas)]
    group = {"epoch": epoch, "addr": addr, "store": store, "timeout_s": timeout_s}
    try:
        for _ in range(2):  # warm-up: group set-up, both shm slots' first-touch pages
            push_once(path, state, receivers, group, bucket_mb << 20, tmp)
        res = push_once(path, state, receivers, group, bucket_mb << 20, tmp)
    finally:
        for r in receivers:
            ray.kill(r)
        if group.get("shm") is not None:
            group["shm"].unlink()
    return {"path": path, "params": sum(v.numel() for v in state.values()), "bytes": nbytes,
            "replicas": n_replicas, **res, "bytes_per_s_per_replica": nbytes / res["push_s"]}


@dataclass
class BenchWeightsConfig:
    out: str = opt("runs/bench_weights.json", "JSON report path")
    params: list = opt([100e6, 500e6], "model sizes (fp32 parameters), e.g. params=[8e6]")
    replicas: list = opt([1, 2], "receiving replica counts")
    paths: list = opt(["collective", "object_store", "disk", "shm"], "weight paths to measure")
    bucket_mb: int = opt(256, "collective path: bucket size")


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m benchmarks.bench_weights", __doc__.splitlines()[0], BenchWeightsConfig)
    if c is None:
        return 2
    out, sizes, counts = Path(c.out), [float(x) for x in c.params], [int(x) for x in c.replicas]
    paths, bucket_mb = list(c.paths), c.bucket_mb
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=max(4, max(counts) + 1), include_dashboard=False,
                 logging_level="ERROR",
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    memcpy = memcpy_bandwidth(min(1 << 28, int(min(sizes)) * 4))
    port = free_port()
    store = WeightGroup.connect("127.0.0.1", port, 300.0, is_master=True)
    results, epoch = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for n_params in sizes:
            for n in counts:
                for path in paths:
                    epoch += 1
                    r = measure(path, n_params, n, bucket_mb, store, ("127.0.0.1", port), epoch, Path(tmp))
                    r["of_memcpy"] = r["bytes_per_s_per_replica"] / memcpy
                    results.append(r)
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
              "memcpy_bytes_per_s": memcpy, "bucket_mb": bucket_mb, "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if started_ray:
        ray.shutdown()
    line = "; ".join(f"{r['params'] / 1e6:.0f}M x{r['replicas']} {r['path']} "
                     f"{r['bytes_per_s_per_replica'] / 1e9:.2f} GB/s ({r['of_memcpy']:.2f})"
                     for r in results)
    print(f"bench_weights [{report['machine']}, memcpy {memcpy / 1e9:.2f} GB/s] {line} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
