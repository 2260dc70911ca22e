"""Ray Train's torch process group, set up by a controller that never imports torch.

Ray Train's controller holds the trainer's backend config from its first line, and
`ray.train.torch.config` (TorchConfig, its backend, the functions it runs on workers)
imports torch at its top: every job's controller paid ~3.4 CPU-seconds and torch's
memory to unpickle a dataclass of three fields. `TorchGroupConfig` is that config in a
module without torch. Its backend runs Ray's own steps, in Ray's order, on the workers
(MASTER_ADDR/PORT from rank 0, the torch.distributed environment, one
`init_process_group` per rank; the shutdown), each through a function here that imports
Ray's on the worker, where torch is loaded anyway. Only the choice of backend is ours:
`nccl` when the workers have GPUs, else `gloo`, as TorchTrainer chooses it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray._private import ray_constants
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.util import TrainingFramework


@dataclass
class TorchGroupConfig(BackendConfig):
    """`backend`: a torch.distributed backend, or None for nccl on GPU workers, else
    gloo; `timeout_s`: the group's collective timeout."""

    backend: str | None = None
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return TorchGroupBackend

    @property
    def train_func_context(self):
        return DeviceContext

    @property
    def framework(self):
        return TrainingFramework.TORCH


def group_backend(backend: str | None, gpus_per_worker: float) -> str:
    return backend or ("nccl" if gpus_per_worker > 0 else "gloo")


class TorchGroupBackend(Backend):
    # GPU workers on one node see each other's devices (NCCL's peer access), as Ray's.
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: TorchGroupConfig) -> None:
        backend = group_backend(backend_config.backend,
                                worker_group.get_resources_per_worker().get("GPU", 0))
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master, addr=addr, port=port)
        worker_group.execute(_set_distributed_env)
        ray.get([worker_group.execute_single_async(
            rank, _init_group, backend=backend, world_rank=rank, world_size=len(worker_group),
            init_method="env://", timeout_s=backend_config.timeout_s)
            for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config: TorchGroupConfig) -> None:
        futures = worker_group.execute_async(_shutdown, destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            print(f"[areal-ray] the torch process group did not shut down in {timeout_s} s",
                  flush=True)


class DeviceContext:
    """Around the train function on each worker: Ray's (the worker's CUDA device)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager
        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


# On the workers: Ray's functions, imported there.

def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_distributed_env() -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars
    _set_torch_distributed_env_vars()


def _init_group(**kwargs) -> None:
    from ray.train.torch.config import _setup_torch_process_group
    _setup_torch_process_group(**kwargs)


def _shutdown(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch
    _shutdown_torch(destroy_process_group=destroy_process_group)
