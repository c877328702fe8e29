"""Which submodules of a stage become FSDP units: wrap policies read from the module tree.

An FSDP unit is a module whose parameters are gathered together, just before its
forward (and its backward), and sharded again afterwards; the smaller the units, the
less of the stage is ever whole at once. Two policies, plus "the whole stage":

* ``block_units``: the blocks of the stage's module stacks (the children of each
  ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict`` that hold parameters, e.g.
  a transformer's layers), as torchtitan shards one unit per transformer block. The
  stage itself, the root unit, keeps whatever is left (embeddings, final norms, heads).
* ``min_params_units``: FairScale's ``auto_wrap(min_num_params=N)`` (``auto_wrap_units``
  with ``default_auto_wrap_policy``): depth first, every module that still holds at least
  N parameters not already in a unit below it becomes one; containers without a forward
  of their own (``ModuleList``, ``ModuleDict``) never do, and ``MultiheadAttention`` is
  neither looked into nor wrapped.

A unit must be entered through its own ``forward``: FSDP gathers its parameters in a
forward pre-hook. The block policy only picks modules that their parent calls (stack
members); a module whose weight the stage reads directly (a tied embedding used as the
output projection) stays in the root unit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.nn as nn

__all__ = [
    "block_units",
    "min_params_units",
    "auto_wrap_units",
    "default_auto_wrap_policy",
    "has_forward",
    "STACKS",
    "WrapPolicy",
]

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


WrapPolicy = Callable[..., bool]


def default_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool = False,
    min_num_params: float = 1e8,
    force_leaf_modules: set[type] | None = None,
    exclude_wrap_modules: set[type] | None = None,
) -> bool:
    """FairScale's default policy: look into (``recurse``) or wrap a module holding at least
    ``min_num_params`` parameters not yet in a unit; never into ``force_leaf_modules``
    (``MultiheadAttention``), never wrap ``exclude_wrap_modules`` (``ModuleList``, ``ModuleDict``)."""
    leaves = tuple(
        force_leaf_modules if force_leaf_modules is not None else {nn.MultiheadAttention}
    )
    excluded = tuple(
        exclude_wrap_modules if exclude_wrap_modules is not None else {nn.ModuleList, nn.ModuleDict}
    )
    large = unwrapped_params >= min_num_params
    if recurse:
        return large and not isinstance(module, leaves)
    return large and not isinstance(module, excluded) and has_forward(module)


def auto_wrap_units(module: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """The modules FairScale's ``auto_wrap`` wraps with ``policy``, children before parents,
    ``module`` itself last when the policy takes it."""
    units: list[nn.Module] = []

    def visit(m: nn.Module, root: bool) -> int:
        """Parameters of ``m`` now inside units."""
        total = _param_count(m)
        if not policy(module=m, recurse=True, unwrapped_params=total, module_is_root=root):
            return 0
        wrapped = sum(visit(child, False) for child in m.children())
        if policy(module=m, recurse=False, unwrapped_params=total - wrapped, module_is_root=root):
            units.append(m)
            return total
        return wrapped

    visit(module, True)
    return units


def min_params_units(stage: nn.Module, min_num_params: int) -> list[nn.Module]:
    """The units below ``stage`` of FairScale's ``auto_wrap(stage, min_num_params=N)`` (the stage,
    the root unit, is sharded by itself anyway).

    >>> net = nn.Sequential(nn.Linear(10, 10), nn.Linear(2, 2))
    >>> [type(m).__name__ for m in min_params_units(net, 100)]
    ['Linear']
    """
    policy = functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)
    return [m for m in auto_wrap_units(stage, policy) if m is not stage]
