"""The function Ray Train runs on every worker, importable without torch.

Ray Train pickles `train_loop_per_worker` by reference, so its controller process
imports the module that defines it just to hold the trainer's definition. Defined in
`train/loop.py` that would load torch, transformers and our whole training stack into
the controller (seconds of CPU on the start-up path, ~300 MB it keeps); defined here,
only the workers import them.
"""


def train_loop_per_worker(config: dict) -> None:
    from areal_ray.train.loop import train_loop_per_worker as run

    run(config)


def sft_loop_per_worker(config: dict) -> None:
    """`jobs.sft`'s worker loop (areal_ray/sft/loop.py), for the same reason."""
    from areal_ray.sft.loop import sft_loop_per_worker as run

    run(config)
