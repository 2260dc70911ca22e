"""`make gpu-venv` checks the machine first (jobs/gpu_prereqs.py): each missing piece is
named, with what the GPU stack needs instead."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import gpu_prereqs as g

SMI_OK = """| NVIDIA-SMI 580.82.07    Driver Version: 580.82.07    CUDA Version: 13.0 |"""
SMI_OLD = """| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4 |"""
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.\n")


def ran(stdout="", returncode=0, stderr=""):
    return lambda cmd: subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def found(*names):
    return lambda name: f"/usr/bin/{name}" if name in names else None


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a machine with a driver")
def test_this_machine_without_a_driver_is_refused_clearly():
    out = subprocess.run([sys.executable, "-m", "jobs.gpu_prereqs", "engine=vllm"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "gpu-venv prerequisite: nvidia-smi not found: no NVIDIA driver on this machine" in out.stderr
    assert "CUDA 13" in out.stderr


def test_an_unknown_engine_is_refused():
    assert g.main(["engine=tgi"]) == 2


@pytest.mark.parametrize("engine,version,ok", [
    ("sglang", (3, 11), True), ("sglang", (3, 12), False), ("sglang", (3, 10), False),
    ("vllm", (3, 11), True), ("vllm", (3, 14), True), ("vllm", (3, 10), False), ("vllm", (3, 15), False)])
def test_python_versions_the_wheels_accept(engine, version, ok):
    problem = g.python_problem(engine, version)
    assert (problem is None) == ok
    if not ok:
        assert f"python3 is {version[0]}.{version[1]}" in problem and "PYTHON=python3.11" in problem


def test_glibc_per_engine():
    assert "glibc is 2.31; the sglang wheels need glibc 2.34+" in g.glibc_problem("sglang", ("glibc", "2.31"))
    assert g.glibc_problem("vllm", ("glibc", "2.31")) is None
    assert g.glibc_problem("sglang", ("glibc", "2.35")) is None
    assert "no glibc found" in g.glibc_problem("vllm", ("", ""))


def test_driver_reported_by_nvidia_smi():
    assert g.driver_problem(found("nvidia-smi"), ran(SMI_OK)) is None
    assert "supports CUDA 12.4 only" in g.driver_problem(found("nvidia-smi"), ran(SMI_OLD))
    failed = g.driver_problem(found("nvidia-smi"), ran(returncode=9, stdout=NO_DRIVER))
    assert "couldn't communicate with the NVIDIA driver" in failed and "not working" in failed
    assert "no CUDA version" in g.driver_problem(found("nvidia-smi"), ran("garbled"))
    assert "nvidia-smi not found" in g.driver_problem(found(), ran(SMI_OK))


def test_nvcc_for_a_flash_attn_build(tmp_path):
    cuda = tmp_path / "bin"
    cuda.mkdir()
    (cuda / "nvcc").write_text("")
    env = {"CUDA_HOME": str(tmp_path)}
    assert g.nvcc_path(found("nvcc"), env) == str(cuda / "nvcc")  # CUDA_HOME first, as torch
    assert g.nvcc_problem(found(), env, ran("Cuda compilation tools, release 13.0, V13.0.88")) is None
    mismatch = g.nvcc_problem(found(), env, ran("Cuda compilation tools, release 12.8, V12.8.93"))
    assert "is CUDA 12.8; flash-attn must be built with CUDA 13" in mismatch


def test_no_nvcc_anywhere_is_named(monkeypatch):
    monkeypatch.setattr(g.os.path, "exists", lambda p: False)
    assert "needs nvcc" in g.nvcc_problem(found(), {}, ran())


def test_old_interpreters_can_parse_it():
    """So that an old python3 prints the version problem instead of a SyntaxError."""
    ast.parse(Path(g.__file__).read_text(), feature_version=(3, 7))
