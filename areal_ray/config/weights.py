"""`weights.*`: how a trained version reaches the rollout replicas (areal_ray/weights/encoding.py).

That NCCL needs GPUs on both ends is a cross-section check (root.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_ray.config.choices import CollectiveBackend, WeightPath
from areal_ray.config.section import opt, require


@dataclass(kw_only=True)
class WeightsConfig:
    path: WeightPath = opt(WeightPath.auto, "how a version reaches the replicas: auto (shm when every replica is on the trainer's node, else collective) | collective (gloo/NCCL group) | shm | object_store | disk")
    bucket_mb: int = opt(256, "collective path: size of one flat broadcast bucket")
    dtype: str = opt("", "dtype sent to the replicas (e.g. bfloat16); empty: the trained dtype")
    timeout_s: float = opt(60.0, "timeout of every collective call (group set-up, each bucket)")
    backend: CollectiveBackend = opt(CollectiveBackend.gloo, "collective backend: gloo (CPU) | nccl (GPU trainers and replicas)")
    probe: bool = opt(True, "after each push every replica scores a fixed 16-token probe and the driver checks it against the trainer's logprobs (a push that changed nothing fails the run)")
    probe_atol: float | None = opt(None, "the exact rule: max |logprob diff| the probe accepts; null: float32 runs take the engine's measured default, runs with a narrower model.dtype, weights.dtype or rollout.dtype the moved rule (each push must move the replica's probe by most of the trainer's change, judged against the gap measured at identical weights: areal_ray/weights/probe.py)")

    def check(self) -> None:
        require(self.bucket_mb >= 1, "weights.bucket_mb must be >= 1")
        require(self.timeout_s > 0, "weights.timeout_s must be > 0")
        require(self.probe_atol is None or self.probe_atol >= 0,
                f"weights.probe_atol must be >= 0 or null (got {self.probe_atol})")
