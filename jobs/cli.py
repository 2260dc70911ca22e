"""The command line every job shares: `--config FILE.yaml`, `key=value` overrides,
and `--help` listing each config key with its default and meaning.

A job's keys are a dataclass (the run `Config` for train and eval; a small one per
benchmark), so the same omegaconf rules hold everywhere: unknown keys and ill-typed
values are errors naming the key, before any work starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from areal_ray.config import Config, ConfigError, help_lines, load_config


def job_config(argv: list[str] | None, prog: str, description: str, schema=Config):
    """The job's validated config, or None after printing the error (exit status 2)."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, description=description,
        epilog="config keys (set in the YAML or as key=value):\n" + "\n".join(help_lines(schema)))
    parser.add_argument("--config", help="YAML config file (see conf/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algo.eta=4")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return load_config(args.config, args.overrides, schema=schema)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def bench_main(argv: list[str] | None, prog: str, description: str, schema, check, run) -> int:
    """A benchmark: its config, `check(c)` for what the schema cannot say (exit status 2
    with the message), then `run(c, argv)` with the folder of `c.out` created."""
    argv = sys.argv[1:] if argv is None else argv
    c = job_config(argv, prog, description, schema)
    if c is None:
        return 2
    try:
        check(c)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(c.out).parent.mkdir(parents=True, exist_ok=True)
    run(c, argv)
    return 0


def distinct_choices(key: str, values, allowed) -> list:
    """`values` as a list if it is non-empty, each one of `allowed` and none twice (a
    benchmark's arms), else a ConfigError naming `key`."""
    values, allowed = list(values), list(allowed)
    if not values or any(v not in allowed for v in values) or len(set(values)) != len(values):
        raise ConfigError(f"{key} must be distinct names from {allowed}, got {values}")
    return values


def write_report(report: dict, out: Path, summary_line) -> dict:
    """A benchmark's end: its one-line summary in the JSON report at `out`, and printed."""
    report["summary"] = summary_line(report)
    out.write_text(json.dumps(report, indent=2))
    print(report["summary"] + f" -> {out}", flush=True)
    return report


def interleaved_runs(out: Path, name: str, repeats: int, arms, run_one) -> list:
    """A benchmark's runs, arms interleaved within each repeat (a, b, a, b, ...) so the
    machine's drift hits every arm alike: `run_one(arm, repeat, run_dir)` for each, the
    run dirs under one timestamped folder next to the report `out`."""
    root = out.parent / f"{out.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    results = []
    for repeat in range(repeats):
        for arm in arms:
            run_dir = (root / f"{arm}-{repeat}").absolute()
            print(f"[{name}] {arm} run {repeat + 1}/{repeats} -> {run_dir}", flush=True)
            results.append(run_one(arm, repeat, run_dir))
    return results


def run_job(argv: list[str] | None, prog: str, description: str, fn) -> int:
    """`fn(cfg)` with the run `Config`; exit status 2 with the message for bad input
    found when the job starts (a model dir, a dataset, a run dir), not a traceback."""
    cfg = job_config(argv, prog, description)
    if cfg is None:
        return 2
    from areal_ray.data.sources import DatasetError
    from areal_ray.run.interrupt import Terminated, raise_on_sigterm
    raise_on_sigterm()
    try:
        fn(cfg)
    except (ConfigError, DatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Terminated as e:  # the shell's status for SIGTERM
        print(f"stopped: {e}", file=sys.stderr)
        return 143
    except KeyboardInterrupt as e:  # Ctrl-C: one line and the shell's status for SIGINT
        print(f"interrupted: {e or 'stopped at once'}", file=sys.stderr)
        return 130
    return 0
