"""Remove what killed jobs left on a cluster: their rollout Serve apps (replicas, CPUs,
GPUs, routes), their weight files in /dev/shm on every node, and Ray Train's
placement-group cleaners that outlived their controllers.

    python -m jobs.cleanup [address=auto] [dry_run=true]

Every job runs the same sweep when it starts (areal_ray/run/job.py); this is for a cluster
no job is about to start on. Resources of jobs still running are never touched: a job
counts as alive while its driver actor (`areal-driver-<tag>`, which Ray ends with the
job's process) is (areal_ray/cluster/ownership.py). Prints one line per resource,
"would remove" with `dry_run=true`; exit status 0, 2 for bad input.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_ray.config import opt
from jobs.cli import job_config

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cleanup:
    address: str = opt("", "the cluster (a GCS address, or auto); empty: RAY_ADDRESS, else auto")
    dry_run: bool = opt(False, "only print what would be removed")


def connect(address: str) -> None:
    import ray
    if not address and os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level="WARNING")  # inside `ray job submit`: its runtime env ships the code
    else:
        # The sweep's per-node tasks import areal_ray: ship this repository to them.
        ray.init(address=address or "auto", logging_level="WARNING",
                 runtime_env={"working_dir": str(REPO_ROOT)})


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m jobs.cleanup", __doc__.split("\n\n")[0], Cleanup)
    if c is None:
        return 2
    from areal_ray.cluster.cleanup import sweep
    connect(c.address)
    lines = sweep(dry_run=c.dry_run).lines()
    for line in lines or ["nothing left by dead jobs"]:
        print(f"[areal-ray] clean-up: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
