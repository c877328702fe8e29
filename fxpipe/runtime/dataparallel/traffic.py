"""``CollectiveCounter``: the collectives one rank issues on a process group, and their bytes.

Every ``torch.distributed`` collective reaches the dispatcher as a ``c10d`` operator
(``c10d::_allgather_base_``, ``c10d::_reduce_scatter_base_``, ``c10d::allreduce_``,
``c10d::broadcast_``, ...) with its tensors and its process group, so a
``TorchDispatchMode`` sees what DDP's reducer, ZeRO's broadcasts and FSDP2's
all-gathers and reduce-scatters really hand to the backend: counts, dtypes, padding.

``wire_bytes`` turns them into the bytes each rank sends over its link under ring
algorithms, the convention of ``fxpipe.partitioner.cost`` (Note [sharding pricing]):
an all-gather of an N-byte result or a reduce-scatter of an N-byte input sends
``(R-1)/R x N``, an all-reduce ``2(R-1)/R x N``, a broadcast ``(R-1)/R x N`` (its
``(R-1) x N`` spread over the R ranks).

>>> with CollectiveCounter(group) as counter:           # doctest: +SKIP
...     runner.step(inputs, targets)
>>> counter.wire_bytes, counter.calls                   # doctest: +SKIP
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CollectiveCounter", "RING_FACTOR"]

# Per collective kind: the share of its bytes (result for all-gather, input otherwise, x (R-1)/R) that
# one rank sends on a ring.
RING_FACTOR = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0, "broadcast": 1.0}

_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
}


def _group_of(args: tuple[Any, ...]) -> dist.ProcessGroup | None:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp, not a group
                continue
    return None


def _bytes(kind: str, args: tuple[Any, ...], name: str) -> int:
    """The collective's size: the gathered result for all-gathers, the input otherwise."""
    if name == "_allgather_base_":
        tensors = [args[0]]
    elif name == "_reduce_scatter_base_":
        tensors = [args[1]]
    elif kind == "all_gather":
        tensors = tree_leaves(args[0])
    elif kind == "reduce_scatter":
        tensors = tree_leaves(args[1])
    else:
        tensors = tree_leaves(args[0])
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued on ``group`` (every group when ``None``) while active.

    ``calls[kind]`` and ``nbytes[kind]`` per kind (``all_gather``, ``reduce_scatter``,
    ``all_reduce``, ``broadcast``); ``wire_bytes`` is what this rank sends on a ring.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group_name = group.group_name if group is not None else None
        self.calls: Counter[str] = Counter()
        self.nbytes: Counter[str] = Counter()
        self.sizes: dict[str, int] = {}  # group size per kind (for wire_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = func.overloadpacket.__name__
            kind = _KINDS.get(name)
            pg = _group_of(tuple(args))
            if kind is not None and pg is not None and self.group_name in (None, pg.group_name):
                self.calls[kind] += 1
                self.nbytes[kind] += _bytes(kind, tuple(args), name)
                self.sizes[kind] = pg.size()
        return func(*args, **(kwargs or {}))

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends for the counted collectives under ring algorithms."""
        return sum(
            RING_FACTOR[k] * (self.sizes[k] - 1) / self.sizes[k] * n for k, n in self.nbytes.items()
        )
