"""Entry point: supervised fine-tuning on the RL trainer (Ray Train, FSDP2).

    python -m jobs.sft --config conf/sft.yaml [key=value ...]
    python -m jobs.sft --config conf/sft.yaml sft.train_path=data/my_sft.jsonl model.path=/models/base

Rows are {prompt, completion} or {messages}; the loss is the completions' mean NLL.
The run's `final_model/` is what `python -m jobs.train ... model.path=<run_dir>/final_model`
starts from. `--help` lists every config key (the SFT job's own: `sft.*`).
"""

from __future__ import annotations

import sys

from jobs.cli import run_job


def sft(cfg) -> dict:
    from areal_ray.sft.job import run_sft  # heavy imports only after the config is valid
    return run_sft(cfg)


def main(argv: list[str] | None = None) -> int:
    return run_job(argv, "python -m jobs.sft",
                   "Supervised fine-tuning (completion NLL) on the RL trainer.", sft)


if __name__ == "__main__":
    sys.exit(main())
