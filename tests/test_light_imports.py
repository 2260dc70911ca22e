"""Processes that only relay our objects must not import torch or transformers.

Ray Train's controller unpickles the config and the train function, Ray Data's
coordinator and dataset manager the pipeline, the driver actor every weight payload.
Each of those paying for torch cost the quickstart ~1 GiB and seconds of start-up
(benchmarks/bench_peers.py), so the boundary is tested: in a fresh interpreter, unpickle
what they receive and look at sys.modules.
"""

import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from areal_ray.config import Config
from areal_ray.data.pipeline import PipelineFactory
from areal_ray.data.stream import PromptDatasource, rows_stream
from areal_ray.train.entry import train_loop_per_worker
from areal_ray.weights.payloads import CollectivePayload, DiskPayload, ShmPayload
from areal_ray.weights.tensor_spec import ITEMSIZE, TensorSpec, plan_buckets

REPO = Path(__file__).resolve().parent.parent


def _unpickled_modules(obj) -> set[str]:
    blob = cloudpickle.dumps(obj)
    code = ("import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True)
    return set(out.stdout.decode().split())


def test_relayed_objects_unpickle_without_torch():
    specs = (TensorSpec("w", (2,), "float32"),)
    payloads = [ShmPayload("/dev/shm/x", 8, specs, (0,)), DiskPayload("/tmp/v1.safetensors"),
                CollectivePayload(1, ("127.0.0.1", 1234), {"r": 1}, 2, specs, 1 << 20)]
    stream = rows_stream([{"uid": "0", "prompt": "1+1=", "answer": "2", "verifier": "math"}])
    factory = PipelineFactory(stream, Config(), "d", "ns", "app", "Rollout")
    source = PromptDatasource(stream, "d", "ns")
    assert _unpickled_modules([Config(), train_loop_per_worker, factory, source, payloads]) == set()


def test_ray_trains_controller_unpickles_its_backend_config_and_train_function_without_torch():
    """What the job's TorchTrainer hands Ray Train's controller: the backend config (and
    its backend) and the train function, wrapped in the config's context. Ray's own
    TorchConfig imports torch wherever it is unpickled (train/torch_group.py)."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.torch.config import TorchConfig

    from areal_ray.train.torch_group import TorchGroupConfig
    trainer = TorchTrainer(train_loop_per_worker, torch_config=TorchGroupConfig(),
                           scaling_config=ScalingConfig(num_workers=2))
    config = trainer.backend_config
    assert config.backend == "gloo"  # TorchTrainer's choice for CPU workers
    assert _unpickled_modules([config, config.backend_cls(), trainer._get_train_func()]) == set()
    assert _unpickled_modules(TorchConfig()) == {"torch"}  # what every controller paid


@pytest.mark.parametrize("backend,gpus,expected", [
    (None, 0, "gloo"), (None, 1, "nccl"), (None, 0.5, "nccl"), ("gloo", 1, "gloo")])
def test_the_group_backend_is_nccl_on_gpu_workers_unless_named(backend, gpus, expected):
    from areal_ray.train.torch_group import group_backend
    assert group_backend(backend, gpus) == expected


def _imported_modules(statement: str) -> set[str]:
    code = (f"import sys; {statement}; "
            "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, cwd=REPO)
    return set(out.stdout.decode().split())


def test_the_config_and_the_job_command_line_import_without_torch():
    """`python -m jobs.train --help` and a config error return at once: neither the
    config package (every section, the choices) nor the jobs' command line pulls torch."""
    assert _imported_modules("import areal_ray.config, areal_ray.config.choices, jobs.cli, jobs.train; "
                             "from areal_ray.config import load_config; load_config('conf/quickstart.yaml')") == set()
    assert _imported_modules("import areal_ray.config, torch") == {"torch"}  # the check can fail


def test_the_check_sees_torch_when_it_is_there():
    assert _unpickled_modules(torch.zeros(1)) == {"torch"}


def test_itemsizes_are_torch_itemsizes():
    for name, size in ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size, name


def test_unknown_dtype_is_named():
    try:
        _ = TensorSpec("w", (2,), "complex64").nbytes
    except ValueError as e:
        assert "complex64" in str(e) and "'w'" in str(e)
    else:
        raise AssertionError("no error")


def test_buckets_split_on_size_and_dtype():
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"),
             TensorSpec("c", (4,), "bfloat16"), TensorSpec("d", (100,), "bfloat16")]
    assert plan_buckets(specs, 32) == [[0, 1], [2], [3]]
