"""Which submodules of a stage become FSDP units: wrap policies read from the module tree.

An FSDP unit is a module whose parameters are gathered together, just before its
forward (and its backward), and sharded again afterwards; the smaller the units, the
less of the stage is ever whole at once. Two policies, plus "the whole stage":

* ``block_units``: the blocks of the stage's module stacks (the children of each
  ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict`` that hold parameters, e.g.
  a transformer's layers), as torchtitan shards one unit per transformer block. The
  stage itself, the root unit, keeps whatever is left (embeddings, final norms, heads).
* ``min_params_units``: FairScale's ``auto_wrap(min_num_params=N)``: depth first, every
  module that still holds at least N parameters not already in a unit below it becomes
  one; containers without a forward of their own (``ModuleList``, ``ModuleDict``) never do.

A unit must be entered through its own ``forward``: FSDP gathers its parameters in a
forward pre-hook. The block policy only picks modules that their parent calls (stack
members); a module whose weight the stage reads directly (a tied embedding used as the
output projection) stays in the root unit.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["block_units", "min_params_units", "has_forward", "STACKS"]

STACKS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines a forward (``ModuleList`` and ``ModuleDict`` do not)."""
    return type(module).forward is not nn.Module.forward


def _param_count(module: nn.Module, skip: set[int] | frozenset[int] = frozenset()) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)


def block_units(stage: nn.Module) -> list[nn.Module]:
    """The members of the outermost module stacks of ``stage`` that hold parameters, in module order.

    A stack inside a block is not looked into (the block is already a unit); ``stage``
    itself is never returned, even when it is a stack.
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, STACKS):
                members = [m for m in child.children() if _param_count(m) and has_forward(m)]
                if members:
                    units.extend(members)
                    continue
            visit(child)

    if isinstance(stage, STACKS):
        units.extend(m for m in stage.children() if _param_count(m) and has_forward(m))
    else:
        visit(stage)
    return units


def min_params_units(module: nn.Module, min_num_params: int) -> list[nn.Module]:
    """FairScale's ``auto_wrap`` policy: below-first, each module (not ``module`` itself) with at
    least ``min_num_params`` parameters outside the units already chosen inside it.

    >>> net = nn.Sequential(nn.Linear(10, 10), nn.Linear(2, 2))
    >>> [type(m).__name__ for m in min_params_units(net, 100)]
    ['Linear']
    """
    units: list[nn.Module] = []
    taken: set[int] = set()

    def visit(m: nn.Module, root: bool) -> None:
        if _param_count(m, taken) < min_num_params:
            return
        for child in m.children():
            visit(child, False)
        if not root and has_forward(m) and _param_count(m, taken) >= min_num_params:
            units.append(m)
            taken.update(id(p) for p in m.parameters())

    visit(module, True)
    return units
