"""The offline install path, rehearsed on this machine (docs/gpu.md, "Without an index"):
the GPU machine of the issue has Python with torch, transformers, numpy, pyarrow and
pandas, no Ray and no index. Here that machine is a fresh venv that sees those five
packages, and everything they need, through links into this repo's .venv (a .pth file:
nothing else of .venv). `python -m jobs.wheelhouse engine=hf have=...` builds the
wheelhouse for this Python; the venv installs from it alone (`--no-index`, the
machine's pip configuration off) as `make gpu-venv ENGINE=hf WHEELHOUSE=...` does, Ray
from its lean wheel; then the quickstart job runs in that venv, from outside the
checkout (the editable install), for two steps, on the production-tokenizer model
(conf/quickstart_bpe.yaml)."""

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HAVE = ("torch", "transformers", "numpy", "pyarrow", "pandas")
# It resolves and downloads from the package index (~150 MiB) and installs ~150 wheels
# (82 s on an idle 2-core machine, docs/gpu.md): AREAL_TEST_WHEELHOUSE=0 leaves it out
# of a run on a machine without the index.
pytestmark = pytest.mark.skipif(os.environ.get("AREAL_TEST_WHEELHOUSE") == "0",
                                reason="AREAL_TEST_WHEELHOUSE=0: no wheelhouse from the index")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_closure(names) -> list[metadata.Distribution]:
    """The distributions `names` need in this interpreter, themselves included."""
    from packaging.requirements import Requirement
    dists = {canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    seen, todo = {}, [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        seen[name] = dists[name]
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return list(seen.values())


def link_machine_packages(venv: Path, into: Path) -> list[str]:
    """The target machine's own packages: links to HAVE's distributions (their modules
    and dist-info) in `into`, which a .pth file puts on the venv's path."""
    into.mkdir()
    linked = set()
    for dist in installed_closure(HAVE):
        for f in dist.files or []:
            top = f.parts[0]
            if top != ".." and top not in linked and top != "__pycache__":
                (into / top).symlink_to(dist.locate_file(top))
                linked.add(top)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "machine-packages.pth").write_text(f"{into}\n")
    return sorted(linked)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd}: {out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_a_fresh_venv_from_the_wheelhouse_alone_runs_the_quickstart(tmp_path):
    wheels = tmp_path / "wheelhouse"
    built = run([sys.executable, "-m", "jobs.wheelhouse", "engine=hf", f"have={','.join(HAVE)}",
                 f"out={wheels}"], cwd=REPO, timeout=900)
    assert built.stdout.startswith(f"wheelhouse {wheels}: "), built.stdout
    manifest = json.loads((wheels / "wheelhouse.json").read_text())
    files = sorted(p.name for p in wheels.glob("*.whl"))
    assert [w["file"] for w in manifest["wheels"]] == files
    assert manifest["bytes"] == sum((wheels / f).stat().st_size for f in files)
    held = {canonical(f.split("-")[0]) for f in files}
    assert not held & {"torch", "transformers", "numpy", "pyarrow", "pandas", "nvidia-nccl-cu13", "triton"}
    assert {"ray", "omegaconf", "mlflow", "math-verify", "peft", "setuptools"} <= held
    (ray_wheel,) = wheels.glob("ray-*.whl")
    names = zipfile.ZipFile(ray_wheel).namelist()
    assert not [n for n in names if n.startswith(("ray/jars/", "ray/dashboard/client/build/static/js/"))]

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    link_machine_packages(venv, tmp_path / "machine")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "RAY_", "VIRTUAL_ENV"))}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [str(venv / "bin/pip"), "install", "-q", "--no-index", "--find-links", str(wheels)]
    run(pip + ["-r", str(REPO / "requirements-gpu-hf.txt")], env=env, cwd=REPO, timeout=900)
    run(pip + ["--no-deps", "-e", str(REPO)], env=env, cwd=REPO, timeout=300)
    run([str(venv / "bin/pip"), "check"], env=env, timeout=120)
    py = str(venv / "bin/python")
    where = run([py, "-c", "import ray, torch, areal_ray; print(ray.__file__, torch.__file__, areal_ray.__file__)"],
                env=env, cwd=tmp_path, timeout=120).stdout.split()
    assert where[0].startswith(str(venv)) and where[1].startswith(str(tmp_path / "machine"))
    assert where[2].startswith(str(REPO))
    assert not (Path(where[0]).parent / "jars").exists()

    run_dir = tmp_path / "run"
    # the quickstart on the production tokenizer (artifacts/tiny-bpe, ChatML prompts):
    # the real job's every stage on it, riding this job
    run([py, "-m", "jobs.train", "--config", str(REPO / "conf/quickstart_bpe.yaml"), "train.steps=2",
         "algo.batch_groups=2", "rollout.group_size=4", "rollout.max_new_tokens=32",
         "run.eval_before=false", "run.eval_after=false", f"run.run_dir={run_dir}",
         f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"],
        env=env, cwd=tmp_path, timeout=900)
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    # every sample trained, and every push applied (the load probe, float32: exact)
    assert all(s["n_samples"] == 8 and s["n_tokens"] > 0 for s in steps)
    assert all(s["probe_max_diff"] == 0.0 for s in steps)
