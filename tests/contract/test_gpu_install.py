"""The GPU requirement files resolve on PyPI as a CUDA machine would resolve them, into
wheels only (nothing to build: flash-attn's sdist failed under build isolation), with
the versions our code is written against, and each environment `make gpu-venv` builds
has a flash-attention path for the trainer without flash-attn. `pip install --dry-run
--report`, with this machine's pip configuration switched off (it prefers a local CPU
torch wheel)."""

import json
import os
import subprocess
import sys

import pytest

from areal_ray.cluster.attention import in_kernels_range

# peft (model.lora's adapter, in the trainer) comes with neither engine.
LORA = {"peft": "0.21.2", "accelerate": "1.15.0"}
EXPECTED = {
    "requirements-gpu.txt": {"sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0",
                             "ray": "2.60.0"} | LORA,
    "requirements-gpu-vllm.txt": {"vllm": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0",
                                  "ray": "2.60.0", "kernels": "0.17.2"} | LORA,
    # our HF engine on the machine's own torch (any version pip finds here)
    "requirements-gpu-hf.txt": {"transformers": "5.19.0", "ray": "2.60.0", "kernels": "0.17.2"} | LORA,
}
# What `make gpu-venv` installs after a file, in its own pip call (it overrides a pin).
LAYERS = {"requirements-gpu.txt": "requirements-gpu-kernels.txt"}


def pip_report(args: list[str], report) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--report", str(report), *args], check=True, env=env, timeout=600)
    return json.loads(report.read_text())["install"]


def versions(items: list[dict]) -> dict[str, str]:
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in items}


def sdists(items: list[dict]) -> list[str]:
    return [i["metadata"]["name"] for i in items if not i["download_info"]["url"].endswith(".whl")]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """The install items of a requirements file, resolved once per file."""
    cache: dict[str, list[dict]] = {}

    def get(path: str) -> list[dict]:
        if path not in cache:
            cache[path] = pip_report(["-r", path], tmp_path_factory.mktemp("pip") / "report.json")
        return cache[path]
    return get


def environment(path: str, resolved, tmp_path) -> dict[str, str]:
    """Package versions of the env `make gpu-venv` builds from `path`: the file, then its
    layer resolved with every other package held at the file's versions."""
    env = versions(resolved(path))
    layer = LAYERS.get(path)
    if layer:
        named = {line.split("==")[0].strip().lower() for line in open(layer)
                 if line.strip() and not line.startswith("#")}
        pins = tmp_path / "constraints.txt"
        pins.write_text("".join(f"{n}=={v}\n" for n, v in env.items() if n not in named))
        items = pip_report(["-r", layer, "-c", str(pins)], tmp_path / "layer.json")
        assert sdists(items) == []
        env |= versions(items)
    return env


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_gpu_requirements_resolve_to_wheels(path, resolved):
    items = resolved(path)
    got = versions(items)
    for name, version in EXPECTED[path].items():
        assert got.get(name) == version, (name, got.get(name))
    assert sdists(items) == []
    assert "flash-attn" not in got  # built separately: `make gpu-venv FLASH_ATTN=1`


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_each_gpu_env_has_a_flash_path(path, resolved, tmp_path):
    """transformers 5.19 falls back to the hub flash kernel only with kernels in its range
    (areal_ray/cluster/attention.py); sglang 0.5.23's own pin (0.14) is outside it."""
    env = environment(path, resolved, tmp_path)
    assert env["transformers"] == "5.19.0"
    assert "kernels" in env and in_kernels_range(env["kernels"]), env.get("kernels")
