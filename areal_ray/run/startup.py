"""In what order a job starts its parts.

Started one after the other, a job's start-up is the sum of its parts': the rollout
replicas (an engine each), the eval before, then Ray Train's controller, its worker
group, the model on each worker and the Ray Data pipeline's actors, ~30 s on the
2-core machine before the first prompt is generated. None of the trainer's start
needs a running replica, so by default it starts at once, beside the replicas; the
driver holds admissions until the eval before has measured the initial weights, so
no prompt is generated and no version trained before that.

One layout starts the engine first: a GPU shared by a rollout replica and a trainer
worker. vLLM and SGLang size their KV cache from the GPU memory free when they start,
so a trainer loading its model at that moment would change what they measure.
"""

from __future__ import annotations

from areal_ray.config import Config


def _fraction(gpus: float) -> bool:
    return 0 < gpus < 1


def sequential_start(cfg: Config) -> str | None:
    """Why the trainer must wait for the replicas to be running; None when it need not."""
    if not cfg.run.overlap_start:
        return "run.overlap_start=false"
    if cfg.train.use_gpu and (_fraction(cfg.train.num_gpus_per_worker)
                              or _fraction(cfg.rollout.num_gpus)):
        return ("a GPU is shared by a rollout replica and a trainer worker: the engine sizes "
                "its memory before the trainer loads")
    return None
