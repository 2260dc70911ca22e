"""The GPU requirement files resolve on PyPI as a CUDA machine would resolve them, into
wheels only (nothing to build: flash-attn's sdist failed under build isolation), with
the versions our code is written against. `pip install --dry-run --report`, with this
machine's pip configuration switched off (it prefers a local CPU torch wheel)."""

import json
import os
import subprocess
import sys

import pytest

EXPECTED = {
    "requirements-gpu.txt": {"sglang": "0.5.23", "torch": "2.14.1", "transformers": "5.19.0",
                             "ray": "2.60.0"},
    "requirements-gpu-vllm.txt": {"vllm": "0.32.0", "torch": "2.13.0", "transformers": "5.19.0",
                                  "ray": "2.60.0"},
}


def resolve(path: str, tmp_path) -> dict:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--report", str(report), "-r", path], check=True, env=env, timeout=600)
    return json.loads(report.read_text())["install"]


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_gpu_requirements_resolve_to_wheels(path, tmp_path):
    items = resolve(path, tmp_path)
    versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}
    for name, version in EXPECTED[path].items():
        assert versions.get(name) == version, (name, versions.get(name))
    sdists = [i["metadata"]["name"] for i in items if not i["download_info"]["url"].endswith(".whl")]
    assert sdists == []
    assert "flash-attn" not in versions  # built separately: `make gpu-venv FLASH_ATTN=1`
    if "sglang" in versions:
        assert "kernels" in versions  # transformers' hub flash kernels work without flash-attn
