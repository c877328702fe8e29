"""The tensor a rank holds of a parameter or gradient: a DTensor's local shard, a plain tensor itself.

Tensor parallelism and FSDP leave a stage with DTensors beside plain tensors; the code that adds up
norms, scales, sums tied gradients or reads found-inf works on what this rank holds. The local
shard is taken without dispatching an op, sharing the DTensor's storage, so in-place work on it
(scaling, an all-reduce) changes the DTensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor (same storage), else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t
