"""Entry point: asynchronous RL training.

    python -m jobs.train --config conf/quickstart.yaml [key=value ...]
    ray job submit --working-dir . -- python -m jobs.train --config conf/quickstart.yaml

`--help` lists every config key with its default and meaning.
"""

from __future__ import annotations

import sys

from jobs.cli import run_job


def train(cfg) -> dict:
    # heavy imports only after the config is valid
    from areal_ray.run.job import run_training
    return run_training(cfg)


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, "python -m jobs.train",
                   "Asynchronous RL (decoupled PPO, bounded staleness) on Ray.", train)


if __name__ == "__main__":
    sys.exit(main())
