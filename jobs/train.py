"""Entry point: asynchronous RL training.

    python -m jobs.train --config conf/quickstart.yaml [key=value ...]
    ray job submit --working-dir . -- python -m jobs.train --config conf/quickstart.yaml

`--help` lists every config key with its default and meaning.
"""

from __future__ import annotations

import argparse
import sys

from areal_ray.config import ConfigError, help_lines, load_config


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m jobs.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Asynchronous RL (decoupled PPO, bounded staleness) on Ray.",
        epilog="config keys (set in the YAML or as key=value):\n" + "\n".join(help_lines()))
    parser.add_argument("--config", help="YAML config file (see conf/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algo.eta=4")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def main(argv: list[str] | None = None) -> int:
    path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from areal_ray.run import (
        run_training,  # heavy imports only after the config is valid
    )
    run_training(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
