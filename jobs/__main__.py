"""`areal-ray <command> ...` (or `python -m jobs <command> ...`): one name for the entry points.

    areal-ray train --config conf/quickstart.yaml algo.eta=4   # = python -m jobs.train ...
    areal-ray bench async steps=20                              # = python -m benchmarks.bench_async ...
    areal-ray <command> --help                                  # the job's own help: its keys

Only a dispatcher: the rest of the command line goes unchanged to the module's
`main(argv)`, which parses it (jobs/cli.py), so `python -m jobs.<name>` and the
command stay the same program. Nothing heavy is imported before the command is
known. It lives in jobs/, next to what it dispatches to, rather than in areal_ray:
the library does not depend on its entry points.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

COMMANDS = {  # command: (module, one line for `areal-ray --help`)
    "train": ("jobs.train", "asynchronous RL training (conf/*.yaml, key=value overrides)"),
    "sft": ("jobs.sft", "supervised fine-tuning (completion NLL) on the RL trainer (conf/sft.yaml)"),
    "eval": ("jobs.eval", "held-out pass@1 / pass@k of a model or a run's checkpoint"),
    "plan": ("jobs.plan", "where a run's replicas and trainers go on a cluster shape, and whether it fits"),
    "cleanup": ("jobs.cleanup", "remove what killed jobs left on a cluster (Serve apps, shm weight files)"),
    "gpu-check": ("jobs.gpu_check", "validate the GPU path piece by piece on one machine"),
    "gpu-prereqs": ("jobs.gpu_prereqs", "what `make gpu-venv` needs from the machine (python, glibc, driver)"),
    "make-tiny": ("jobs.make_tiny", "build the embedded tiny models (artifacts/tiny, tiny-tools, tiny-agents, tiny-chains)"),
    "make-code-tasks": ("jobs.make_code_tasks", "write the embedded coding problems as jsonl"),
}
BENCH_PACKAGE, BENCH_PREFIX = "benchmarks", "bench_"


def bench_names() -> list[str]:
    """`bench_<name>.py` in benchmarks/, found without importing any of them."""
    pkg = importlib.import_module(BENCH_PACKAGE)
    return sorted(m.name[len(BENCH_PREFIX):] for m in pkgutil.iter_modules(pkg.__path__)
                  if m.name.startswith(BENCH_PREFIX))


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: areal-ray <command> [args ...]   (`areal-ray <command> --help`: the command's own options)",
             "", "commands:"]
    lines += [f"  {name:<{width}}{doc}  [python -m {mod}]" for name, (mod, doc) in COMMANDS.items()]
    lines += [f"  {'bench':<{width}}a benchmark: areal-ray bench <name> ...  [python -m {BENCH_PACKAGE}.{BENCH_PREFIX}<name>]",
              f"  {'':<{width}}names: {', '.join(bench_names())}"]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """(module, the rest of the command line) for `argv` after the program name;
    ValueError with the reason for an unknown or missing command."""
    if not argv:
        raise ValueError("a command is needed")
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        names = bench_names()
        if not rest or rest[0] not in names:
            got = f"unknown benchmark {rest[0]!r}" if rest else "a benchmark name is needed"
            raise ValueError(f"{got}: one of {', '.join(names)}")
        return f"{BENCH_PACKAGE}.{BENCH_PREFIX}{rest[0]}", rest[1:]
    if cmd not in COMMANDS:
        raise ValueError(f"unknown command {cmd!r}: one of {', '.join([*COMMANDS, 'bench'])}")
    return COMMANDS[cmd][0], rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        module, rest = resolve(argv)
    except ValueError as e:
        print(f"areal-ray: {e}\n\n{usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
