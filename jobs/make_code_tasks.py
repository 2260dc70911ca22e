"""Entry point: write the embedded coding problems as jsonl (default data/code_tasks.jsonl).

    python -m jobs.make_code_tasks [out=data/code_tasks.jsonl] [seed=0]
"""

from __future__ import annotations

import sys

from areal_ray.task.code_problems import make_rows, write_jsonl


def main(argv: list[str] | None = None) -> int:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    out, seed = args.get("out", "data/code_tasks.jsonl"), int(args.get("seed", 0))
    rows = make_rows(seed)
    write_jsonl(rows, out)
    print(f"wrote {len(rows)} coding problems to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
