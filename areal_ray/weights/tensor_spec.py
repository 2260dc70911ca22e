"""What a weight push announces about each tensor, importable without torch.

A push's payload (name, shape, transfer dtype per tensor) travels through the driver
actor, which only relays it: defining the spec next to the torch code would make every
process that unpickles a payload import torch (seconds of start-up, ~150 MB each).
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of the dtypes a checkpoint can hold, by torch's name without the
# "torch." prefix (tests/test_tensor_spec.py checks them against torch).
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the transfer dtype, e.g. "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        return self.numel * ITEMSIZE[self.dtype]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Consecutive specs grouped into buckets of at most `bucket_bytes` (a tensor larger
    than that gets a bucket of its own); all tensors of a bucket share one dtype."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, s in enumerate(specs):
        nbytes = s.nbytes
        if buckets and size + nbytes <= bucket_bytes and s.dtype == dtype:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size, dtype = nbytes, s.dtype
    return buckets
