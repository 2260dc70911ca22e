"""What `make gpu-venv` needs from the machine, checked before it installs anything:

    python3 -m jobs.gpu_prereqs engine=sglang|vllm [flash_attn=1]

* python3, which the venv is made from: 3.11 for sglang (its 0.5.23 wheel is cp311
  only), 3.11 to 3.14 for vllm (0.32's Requires-Python); the project needs 3.11+.
* glibc: manylinux_2_34 for the sglang wheel, manylinux_2_28 for vllm's and torch's.
* An NVIDIA driver that `nvidia-smi` reports, new enough for CUDA 13: both torch wheels
  (2.14.1 for sglang, 2.13.0 for vllm) are CUDA 13 builds. Without it torch sees no GPU
  and the GPU check runs on CPU.
* With flash_attn=1: nvcc of the same CUDA major, as flash-attn builds from source.

Every problem is reported at once. Runs on the system python3 before the venv exists:
standard library only, and syntax old interpreters parse, so that an old python3 gets
this message rather than a SyntaxError.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

CUDA_MAJOR = 13  # of the torch wheels both GPU requirement files resolve to
ENGINES = {  # engine: (lowest Python, highest Python, lowest glibc)
    "sglang": ((3, 11), (3, 11), (2, 34)),
    "vllm": ((3, 11), (3, 14), (2, 28)),
}


def dotted(version) -> str:
    return ".".join(str(v) for v in version)


def python_problem(engine: str, version=sys.version_info[:2]) -> str | None:
    low, high, _ = ENGINES[engine]
    if low <= tuple(version) <= high:
        return None
    want = dotted(low) if low == high else f"{dotted(low)} to {dotted(high)}"
    return (f"python3 is {dotted(version)}; ENGINE={engine} needs Python {want}. "
            f"Pass another interpreter: make gpu-venv PYTHON=python{dotted(low)}")


def glibc_problem(engine: str, libc=None) -> str | None:
    name, version = libc or platform.libc_ver()
    need = ENGINES[engine][2]
    if name != "glibc":
        return f"no glibc found ({name or 'unknown libc'}); the {engine} wheels need glibc {dotted(need)}+"
    have = tuple(int(p) for p in version.split(".")[:2])
    if have < need:
        return f"glibc is {version}; the {engine} wheels need glibc {dotted(need)}+ (a newer OS image)"
    return None


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def driver_problem(which=shutil.which, run=run) -> str | None:
    need = (f"an NVIDIA driver for CUDA {CUDA_MAJOR} (R580 or newer; the torch wheels are "
            f"CUDA {CUDA_MAJOR} builds)")
    if which("nvidia-smi") is None:
        return f"nvidia-smi not found: no NVIDIA driver on this machine; the GPU stack needs {need}"
    out = run(["nvidia-smi"])
    if out.returncode != 0:
        detail = ((out.stderr or out.stdout).strip().splitlines() or [f"exit {out.returncode}"])[0]
        return f"nvidia-smi failed ({detail}): the driver is not working; needs {need}"
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out.stdout)
    if m is None:
        return f"nvidia-smi reports no CUDA version; needs {need}"
    if int(m.group(1)) < CUDA_MAJOR:
        return f"the driver supports CUDA {m.group(1)}.{m.group(2)} only; needs {need}"
    return None


def nvcc_path(which=shutil.which, env=os.environ) -> str | None:
    """Where torch's extension builder finds nvcc: CUDA_HOME, PATH, /usr/local/cuda."""
    for path in (os.path.join(env.get("CUDA_HOME", ""), "bin", "nvcc") if env.get("CUDA_HOME") else None,
                 which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if path and os.path.exists(path):
            return path
    return None


def nvcc_problem(which=shutil.which, env=os.environ, run=run) -> str | None:
    nvcc = nvcc_path(which, env)
    if nvcc is None:
        return (f"FLASH_ATTN=1 builds flash-attn from source and needs nvcc (CUDA {CUDA_MAJOR} "
                f"toolkit; CUDA_HOME or PATH); none found. Without FLASH_ATTN=1 the trainer uses "
                f"the hub flash kernel")
    m = re.search(r"release (\d+)\.(\d+)", run([nvcc, "--version"]).stdout)
    if m is None or int(m.group(1)) != CUDA_MAJOR:
        found = f"{m.group(1)}.{m.group(2)}" if m else "unknown"
        return f"{nvcc} is CUDA {found}; flash-attn must be built with CUDA {CUDA_MAJOR}, torch's"
    return None


def problems(engine: str, flash_attn: bool) -> list[str]:
    found = [python_problem(engine), glibc_problem(engine), driver_problem()]
    if flash_attn:
        found.append(nvcc_problem())
    return [p for p in found if p]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    bad = [a for a in argv if "=" not in a]
    if bad:
        print("gpu-venv prerequisites: expected key=value (engine=, flash_attn=), got " + " ".join(bad),
              file=sys.stderr)
        return 2
    args = dict(a.split("=", 1) for a in argv)
    engine, flash_attn = args.get("engine", "sglang"), args.get("flash_attn", "") not in ("", "0")
    if engine not in ENGINES:
        print(f"gpu-venv: ENGINE={engine} is not one of {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    found = problems(engine, flash_attn)
    for p in found:
        print(f"gpu-venv prerequisite: {p}", file=sys.stderr)
    if not found:
        print(f"gpu-venv prerequisites OK for ENGINE={engine}"
              f"{' with FLASH_ATTN=1' if flash_attn else ''}: Python {dotted(sys.version_info[:3])}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
