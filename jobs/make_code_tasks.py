"""Entry point: write the embedded coding problems as jsonl (default data/code_tasks.jsonl).

    python -m jobs.make_code_tasks [out=data/code_tasks.jsonl] [seed=0]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from areal_ray.config import opt
from areal_ray.task.code_problems import make_rows, write_jsonl
from jobs.cli import job_config


@dataclass
class MakeCodeTasks:
    out: str = opt("data/code_tasks.jsonl", "the jsonl file to write")
    seed: int = opt(0, "seed of the generated problems")


def main(argv: list[str] | None = None) -> int:
    c = job_config(argv, "python -m jobs.make_code_tasks", __doc__.splitlines()[0], MakeCodeTasks)
    if c is None:
        return 2
    rows = make_rows(c.seed)
    write_jsonl(rows, c.out)
    print(f"wrote {len(rows)} coding problems to {c.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
