"""An offline wheelhouse: every wheel a GPU environment needs, for a named Python and
platform, in one folder, so that a machine without a package index can install it:

    python -m jobs.wheelhouse [engine=sglang|vllm|hf] [python=3.11] [platform=manylinux_2_34_x86_64]
                              [have=torch,transformers,...] [dashboard=0] [out=wheelhouse]
    make gpu-venv ENGINE=<engine> WHEELHOUSE=<out>     # on the machine without an index

Run it where pip reaches an index. The engine names the requirement files, as `make
gpu-venv` installs them: sglang requirements-gpu.txt, then requirements-gpu-kernels.txt
resolved against it; vllm requirements-gpu-vllm.txt; hf requirements-gpu-hf.txt (our HF
engine only, on the machine's own torch). The platform defaults to the oldest glibc
the engine's wheels need (sglang's: manylinux_2_34; the others: manylinux_2_28). The
build backend of `pip install -e .`
(pyproject.toml) comes too, since the editable install builds offline as well.

* have: what the target machine already has (`name` or `name==version`). Those
  packages are left out, and so is every package that only they need: the rest is what
  the requirement files reach without passing through them. A pinned `name==version`
  also holds the resolution to that version, so what is kept fits what the target has;
  a bare name is left out whatever its version there.
* The lean set: Ray's wheel is repacked without its Java jars (ray/jars: 31 of Ray's
  75 MiB; Java workers only) and, unless dashboard=1, without the dashboard's web client
  (its scripts; the dashboard's HTTP API, which `ray job submit` uses, stays), its RECORD
  rewritten so that pip installs it as any other wheel.
* Resolution is pip's (`pip install --dry-run --report`, wheels only, with the target's
  tags); environment markers are evaluated by pip for the Python that runs this job, so
  run it with the target's minor version where a dependency differs by it.

Writes `<out>/wheelhouse.json` (what it holds, what was left out, its size) and prints
one line. Standard library and pip only: it runs before any venv exists.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name as canonical
except ImportError:  # pip's own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name as canonical

from jobs.gpu_prereqs import ENGINES

REPO = Path(__file__).resolve().parent.parent
LAYERS = {  # engine: requirement files in install order (`make gpu-venv`)
    "sglang": ("requirements-gpu.txt", "requirements-gpu-kernels.txt"),
    "vllm": ("requirements-gpu-vllm.txt",),
    "hf": ("requirements-gpu-hf.txt",),
}
# The oldest glibc each engine's wheels need (jobs/gpu_prereqs.py checks the machine):
# the default target platform, which also admits every wheel built for an older one.
PLATFORMS = {**{e: "manylinux_{}_{}_x86_64".format(*glibc) for e, (_, _, glibc) in ENGINES.items()},
             "hf": "manylinux_2_28_x86_64"}
KEYS = ("engine", "python", "platform", "have", "dashboard", "out")
RAY_JARS = "ray/jars/"
# The web client's scripts and the profiler viewer. index.html, the icon, the fonts and
# build/static itself stay: the dashboard refuses to start without build/static.
RAY_DASHBOARD_CLIENT = ("ray/dashboard/client/build/static/js/",
                        "ray/dashboard/client/build/speedscope-")
MANIFEST = "wheelhouse.json"
MIB = 2**20


def expand_platform(platform: str) -> list[str]:
    """pip's --platform matches a tag exactly, so a manylinux_2_Y target is given with
    every older manylinux tag it runs, legacy aliases included (a wheel tagged
    manylinux2014 only is common)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    top, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{y}_{arch}" for y in range(top, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{alias}_{arch}" for y, alias in legacy.items() if y <= top]


def target_args(python: str, platform: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in expand_platform(platform):
        args += ["--platform", p]
    return args


def requirements(path: Path) -> list[Requirement]:
    """The requirement lines of a pip requirements file (options and comments skipped)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith(("#", "-")):
            out.append(Requirement(line))
    return out


def parse_have(have: str) -> dict[str, str]:
    """`torch,numpy==2.1.0` -> {"torch": "", "numpy": "2.1.0"}."""
    out = {}
    for part in filter(None, (p.strip() for p in have.split(","))):
        name, _, version = part.partition("==")
        out[canonical(name)] = version.strip()
    return out


def needed(items: list[dict], roots: list[Requirement], have, env: dict) -> dict[str, dict]:
    """The install items (pip's report) that `roots` reach without passing through a
    package in `have`: a package that only `have` packages need is the target's already.
    Extras are followed (ray[serve] reaches what its serve extra names)."""
    by_name = {canonical(i["metadata"]["name"]): i for i in items}
    keep: dict[str, dict] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(canonical(r.name), sorted(r.extras)) for r in roots]
    while todo:
        name, extras = todo.pop()
        if name in have or name not in by_name:  # not needed on this target (a marker)
            continue
        keep[name] = by_name[name]
        for extra in ["", *extras]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in by_name[name]["metadata"].get("requires_dist", []):
                req = Requirement(line)
                if req.marker is None or req.marker.evaluate(dict(env, extra=extra)):
                    todo.append((canonical(req.name), sorted(req.extras)))
    return keep


def strip_wheel(src: Path, dst: Path, drop) -> list[str]:
    """`src` rewritten to `dst` without the files `drop(path)` selects, its RECORD without
    their rows (pip refuses a wheel whose RECORD names a file it lacks). Returns the
    dropped paths."""
    dropped = []
    with zipfile.ZipFile(src) as zin:
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename == record:
                    continue
                if drop(info.filename):
                    dropped.append(info.filename)
                    continue
                zout.writestr(info, zin.read(info.filename), compress_type=info.compress_type)
            gone = set(dropped)
            rows = [r for r in csv.reader(io.StringIO(zin.read(record).decode())) if r and r[0] not in gone]
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(rows)
            zout.writestr(zin.getinfo(record), text.getvalue())
    return dropped


def lean_drop(dashboard: bool):
    def drop(path: str) -> bool:
        return path.startswith(RAY_JARS) or (not dashboard and path.startswith(RAY_DASHBOARD_CLIENT))
    return drop


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def resolve(files: list[Path], extra: list[str], have: dict[str, str], python: str, platform: str,
            tmp: Path) -> tuple[dict[str, dict], set[str]]:
    """Every item each file needs on the target (a later file resolved with the earlier
    ones' versions held, as `make gpu-venv` installs it over them), and what `have` took."""
    keep: dict[str, dict] = {}
    left_out: set[str] = set()
    held: dict[str, str] = {n: v for n, v in have.items() if v}
    for k, path in enumerate(files):
        roots = requirements(path) + [Requirement(r) for r in (extra if k == 0 else [])]
        named = {canonical(r.name) for r in roots}
        pins = tmp / f"constraints-{k}.txt"
        pins.write_text("".join(f"{n}=={v}\n" for n, v in held.items() if n not in named or n in have))
        report = tmp / f"report-{k}.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
            *target_args(python, platform), "-c", str(pins), "-r", str(path), *(extra if k == 0 else []))
        data = json.loads(report.read_text())
        items = data["install"]
        env = dict(default_environment(), **data.get("environment", {}))
        layer = needed(items, roots, have, env)
        left_out |= {canonical(i["metadata"]["name"]) for i in items} - set(layer)
        keep |= {f"{n}=={i['metadata']['version']}": i for n, i in layer.items()}
        held |= {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    return keep, left_out - {k.split("==")[0] for k in keep} - set(have)


def build(engine: str, python: str, platform: str, have: dict[str, str], dashboard: bool, out: Path) -> dict:
    files = [REPO / f for f in LAYERS[engine]]
    backend = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        keep, left_out = resolve(files, backend, have, python, platform, Path(tmp))
        for old in out.glob("*.whl"):  # a previous build's
            old.unlink()
        pip("download", "--no-deps", "--quiet", "-d", str(out), *target_args(python, platform), *sorted(keep))
    wheels = []
    for whl in sorted(out.glob("*.whl")):
        entry = {"file": whl.name, "bytes": whl.stat().st_size}
        if canonical(whl.name.split("-")[0]) == "ray":
            lean = whl.with_suffix(".lean")
            dropped = strip_wheel(whl, lean, lean_drop(dashboard))
            lean.replace(whl)
            entry |= {"bytes": whl.stat().st_size, "original_bytes": entry["bytes"],
                      "left_out_files": len(dropped)}
        wheels.append(entry)
    size = sum(w["bytes"] for w in wheels)
    manifest = {
        "engine": engine, "python": python, "platform": platform,
        "requirements": [f.name for f in files], "have": have, "dashboard": dashboard,
        "packages": sorted(keep), "left_out": sorted(left_out), "wheels": wheels,
        "bytes": size, "mib": round(size / MIB, 1),
        "install": f"make gpu-venv ENGINE={engine} WHEELHOUSE={out}",
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def summary(m: dict, out: Path) -> str:
    have = f", without {','.join(m['have'])} and {len(m['left_out'])} packages only they need" if m["have"] else ""
    lean = "Ray without its jars" + ("" if m["dashboard"] else " and dashboard client")
    return (f"wheelhouse {out}: {len(m['wheels'])} wheels, {m['mib']} MiB, for cp{m['python'].replace('.', '')} "
            f"{m['platform']}, ENGINE={m['engine']}{have}; {lean}; install: {m['install']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    bad = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in KEYS]
    if bad:
        print(f"wheelhouse: expected key=value with keys {', '.join(KEYS)}, got " + " ".join(bad), file=sys.stderr)
        return 2
    args = dict(a.split("=", 1) for a in argv)
    engine = args.get("engine", "sglang")
    if engine not in LAYERS:
        print(f"wheelhouse: engine={engine} is not one of {', '.join(LAYERS)}", file=sys.stderr)
        return 2
    python = args.get("python", f"{sys.version_info[0]}.{sys.version_info[1]}")
    out = Path(args.get("out", "wheelhouse"))
    platform = args.get("platform", PLATFORMS[engine])
    try:
        m = build(engine, python, platform, parse_have(args.get("have", "")),
                  args.get("dashboard", "0") not in ("", "0", "false"), out)
    except subprocess.CalledProcessError as e:  # pip said why, above
        print(f"wheelhouse: pip failed ({' '.join(e.cmd[3:5])}) for ENGINE={engine}, Python {python}, {platform}: "
              "see its message above (a `have` pin the requirement files exclude, or no wheel for this target)",
              file=sys.stderr)
        return 1
    print(summary(m, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
