"""Tied parameters between the chunks of one rank when each chunk is its own FSDP module.

A rank that runs several chunks (``--virtual-stages``) shares a tied parameter between
them in memory (``fxpipe.runtime.pipeline.rank_stages.share_tied_parameters``). FSDP2 manages each
parameter in exactly one ``fully_shard`` unit, so before the chunks are sharded one by one
(Note [sharding in a pipeline]) every chunk after the first that holds a shared parameter
gets its own copy (``untie_chunks``): the copies start equal, as the tied copies on
different ranks do. After the step's backward ``TiedCopies`` gives every copy the sum of
their gradients (sharded alike, so the local shards add), which is what autograd summed
into the one shared ``.grad`` before; any optimizer then keeps the copies equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from fxpipe.runtime.local_shard import local_tensor

__all__ = ["TiedCopies", "untie_chunks"]

# where a parameter lives: (owning module, attribute name); looked up again after fully_shard
# replaced the parameter by its sharded DTensor
_Slot = tuple[nn.Module, str]


def _slots(module: nn.Module) -> list[tuple[_Slot, nn.Parameter]]:
    return [
        ((owner, name), p)
        for owner in module.modules()
        for name, p in owner._parameters.items()
        if p is not None
    ]


def untie_chunks(chunks: Sequence[nn.Module]) -> list[list[_Slot]]:
    """Give each chunk its own copy of every parameter it shares with an earlier chunk; for each
    such parameter, the slots of all its copies (the original's first)."""
    first_chunk: dict[int, int] = {}
    ties: dict[int, list[_Slot]] = {}
    for c, chunk in enumerate(chunks):
        copies: dict[int, nn.Parameter] = {}
        for slot, p in _slots(chunk):
            if first_chunk.setdefault(id(p), c) == c:
                ties.setdefault(id(p), [slot])  # the original, in its first slot
                continue
            if (
                id(p) not in copies
            ):  # one copy per chunk, listed once however often the chunk holds it
                copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                ties[id(p)].append(slot)
            owner, name = slot
            owner._parameters[name] = copies[id(p)]
    return [slots for slots in ties.values() if len(slots) > 1]


def _param(slot: _Slot) -> torch.Tensor:
    owner, name = slot
    p = owner._parameters[name]
    assert p is not None, "a tied copy stays a parameter"
    return p


class TiedCopies:
    """The copies ``untie_chunks`` made, and the sum of their gradients after backward.

    ``share_grads`` (before the cross-rank tie all-reduce, ``fxpipe.runtime.pipeline.ties``) gives all
    copies of a parameter one gradient tensor holding their sum, so that the all-reduce of
    any copy's gradient updates all of them; ``own_grads`` (after it) gives each copy its
    own tensor again, so that in-place gradient clipping scales each once.
    """

    def __init__(self, ties: list[list[_Slot]]) -> None:
        self.ties = ties

    def share_grads(self) -> None:
        for slots in self.ties:
            params = [_param(s) for s in slots]
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                local_tensor(total).add_(local_tensor(g))
            for p in params:
                p.grad = total

    def own_grads(self) -> None:
        for slots in self.ties:
            params = [_param(s) for s in slots]
            for p in params[1:]:
                if p.grad is not None and p.grad is params[0].grad:
                    p.grad = p.grad.clone()
