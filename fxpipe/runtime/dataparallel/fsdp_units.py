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

Note [units small enough to save]: under ZeRO-3 (``shard="full"``) a rank keeps 1/R of its
stage's P parameters, saving P(1 - 1/R), but a unit is whole while it runs, and on CPU, during
its copy-out, twice (FSDP2 gathers into one flat buffer and copies each parameter out of it).
A block that is a large part of its stage spends the saving on itself: ``examples/gpt.py``
with 2 blocks a stage (a block 45% of the stage's parameters) peaked at 1.02-1.05x the
unsharded run on 2 replicas. ``split_units`` therefore gives a unit over a limit (the
sharded stage passes a quarter of what sharding saves, so whole units cost at most half of
it) units of its children instead, as FairScale's ``auto_wrap`` would, but only children
that its ``forward`` enters through their own ``forward`` and reads no other way
(``called_children``: read from its source, so the generated stage classes and plain
modules split, and code that reaches into a child, loops over it or hands ``self`` away
does not); the unit keeps whatever its children do not take (nested, as torchtitan nests
its units). The root unit (the stage) is whole for the stage's whole forward and whole
backward, so ``root_child_units`` also gives each child the stage calls and that holds
parameters of its own (an embedding, a final norm, an output head, as torchtitan shards
them) a unit. ``tests/runtime/dataparallel/test_sharded_training.py`` holds ``examples/gpt.py``'s
two stages under 0.95x the unsharded peak (figures: benchmarks/dataparallel/README.md).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from fxpipe.runtime.dataparallel.options import DataParallelOptions

__all__ = [
    "stage_units",
    "compile_regions",
    "block_units",
    "min_params_units",
    "auto_wrap_units",
    "called_children",
    "split_units",
    "root_child_units",
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


def called_children(module: nn.Module) -> set[str]:
    """The children that ``module``'s ``forward`` enters only by calling them, once each and outside
    any loop (``self.name(...)``); empty when the source cannot be read or ``forward`` uses
    ``self`` in a way that could reach a child's parameters otherwise (handing ``self`` on,
    calling its methods or ``super()``'s, reading attributes that are not plain data). A child read any other
    way (``self.emb.weight``) is left out (Note [units small enough to save]).

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b, self.scale = nn.Linear(2, 2), nn.Linear(2, 2), 2.0
    ...     def forward(self, x):
    ...         return self.a(x) * self.scale + x @ self.b.weight
    >>> sorted(called_children(Net()))
    ['a']
    """
    forward = type(module).forward
    if forward is nn.Module.forward:
        return set()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return set()
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef) or not func.args.args:
        return set()
    me = func.args.args[0].arg
    if any(isinstance(n, ast.Name) and n.id == "super" for n in ast.walk(func)):
        return set()  # the parent class's forward may read the children any way
    parent = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    children = dict(module.named_children())
    calls: dict[str, int] = {}
    other: set[str] = set()
    loops = (ast.For, ast.AsyncFor, ast.While, ast.comprehension, ast.Lambda)
    for node in ast.walk(func):
        if not (isinstance(node, ast.Name) and node.id == me) or node is func.args.args[0]:
            continue
        attr = parent.get(node)
        if not isinstance(attr, ast.Attribute) or attr.value is not node:
            return set()  # ``self`` handed on: anything may read the children
        name = attr.attr
        if name in children:
            call = parent.get(attr)
            if (
                isinstance(call, ast.Call)
                and call.func is attr
                and not _inside(attr, parent, loops)
            ):
                calls[name] = calls.get(name, 0) + 1
            else:
                other.add(name)
        elif not (
            name in module._parameters
            or name in module._buffers
            or isinstance(
                module.__dict__.get(name, getattr(type(module), name, None)),
                (int, float, bool, str, type(None), tuple),
            )
        ):
            return set()  # a method or property: code this does not read
    return {name for name, n in calls.items() if n == 1 and name not in other}


def _inside(node: ast.AST, parent: dict[ast.AST, ast.AST], kinds: tuple[type, ...]) -> bool:
    while node in parent:
        node = parent[node]
        if isinstance(node, kinds):
            return True
    return False


def split_units(units: list[nn.Module], limit: float) -> list[nn.Module]:
    """``units`` with each one holding more than ``limit`` parameters replaced by units of the
    children its ``forward`` calls (``called_children``), again split while over the limit,
    then itself when it still holds parameters they do not (Note [units small enough to save]).
    Children first and in module order, so the order stays one that backward reverses."""
    out: list[nn.Module] = []
    for unit in units:
        out += _split(unit, limit)
    return out


def _split(unit: nn.Module, limit: float) -> list[nn.Module]:
    if _param_count(unit) <= limit:
        return [unit]
    called = called_children(unit)
    kids = [
        child
        for name, child in unit.named_children()
        if name in called and _param_count(child) and has_forward(child)
    ]
    seen: set[int] = set()
    for child in kids:  # a parameter shared by two children would be sharded twice
        ids = {id(p) for p in child.parameters()}
        if ids & seen:
            return [unit]
        seen |= ids
    inner = [u for child in kids for u in _split(child, limit)]
    if not inner:
        return [unit]
    if any(id(p) not in seen for p in unit.parameters()):
        inner.append(unit)  # the rest: whole for the unit's whole forward and backward
    return inner


def root_child_units(stage: nn.Module, units: list[nn.Module], limit: float) -> list[nn.Module]:
    """``units`` (of ``stage``'s blocks) and a unit for each child that ``stage``'s ``forward``
    calls (``called_children``) and that holds parameters nothing else in the stage shares,
    split while over ``limit`` (``split_units``), in module order (Note [units small enough
    to save])."""
    called = called_children(stage)
    owners: dict[int, set[str]] = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name.split(".")[0])
    out: list[nn.Module] = []
    for name, child in stage.named_children():
        inner = {id(m) for m in child.modules()}
        mine = [u for u in units if id(u) in inner]
        if mine:
            out += mine
        elif (
            name in called
            and _param_count(child)
            and has_forward(child)
            and all(owners[id(p)] == {name} for p in child.parameters())
        ):
            out += _split(child, limit)
    out += [u for u in units if u not in out]  # below a child no forward reaches by name
    return out


def stage_units(stage: nn.Module, options: DataParallelOptions, replicas: int) -> list[nn.Module]:
    """The FSDP units of ``stage`` below its root, chosen by ``options.shard_wrap``. Under
    ``full`` a block over a quarter of what sharding saves is split into its children, and the
    children the stage calls get units of their own (Note [units small enough to save])."""
    if options.shard_wrap == "block":
        units = block_units(stage)
        if options.shard == "full" and replicas > 1:
            saved = sum(p.numel() for p in stage.parameters()) * (1 - 1 / replicas)
            units = root_child_units(stage, split_units(units, saved / 4), saved / 4)
        return units
    if options.shard_wrap == "params":
        assert options.shard_min_params is not None, "checked by DataParallelOptions"
        return min_params_units(stage, options.shard_min_params)
    return []


def compile_regions(
    stages: Mapping[int, nn.Module], options: DataParallelOptions, replicas: int
) -> dict[int, list[str]] | None:
    """Per stage, the paths of the units ``stage_units`` gives it that hold no other unit: what a
    compiled stage compiles when it is sharded (Note [compile scope] in
    ``fxpipe.runtime.pipeline.compiled``; empty when the stage is its only unit); ``None`` when
    the stages are not sharded (no FSDP, or one replica)."""
    if not (options.fsdp and replicas > 1):
        return None
    regions = {}
    for s, stage in stages.items():
        units = stage_units(stage, options, replicas)
        ids = {id(u) for u in units}
        leaves = {id(u) for u in units if not any(id(m) in ids for m in list(u.modules())[1:])}
        regions[s] = [path for path, m in stage.named_modules() if id(m) in leaves]
    return regions
