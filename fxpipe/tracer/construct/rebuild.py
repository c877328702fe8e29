"""Rebuilding a module from its configuration: the constructor call that gives the same module.

Note [rebuilt modules equal the original]: a stage file builds each module it keeps whole
again (``torch.nn.Linear(32, 64)``; a user class from the arguments its ``__init__`` got,
recorded by :mod:`fxpipe.tracer.construct.record`) and loads the weights into it. The weights are not
the whole module: ``batch_first``, ``dropout``, ``eps``, ``padding_mode`` live in plain
attributes, and a layer rebuilt from part of them runs and computes something else
(``nn.MultiheadAttention(32, 4)`` for one built with ``batch_first=True, dropout=0.1``: same
parameters, same ``repr``). So a rebuilt module stands for the original only when
:func:`configuration_difference` finds nothing: the same class; every attribute that is not a
parameter, buffer, submodule, hook table or the ``training`` flag, compared by value
(tensors held as plain attributes by shape and dtype); the parameter and buffer names,
shapes, dtypes and persistence; ``extra_repr()``; the hooks; and all of it again for every
submodule. Two kinds of attribute that only the original has are let through, because no
``forward`` can read them: markers a library puts on every module (``FOREIGN_MARKERS``,
e.g. transformers' ``_is_hf_initialized``), and, on a ``torch.nn`` layer, anything its class
neither sets in ``__init__`` nor defines (torch's code reads only those; an instance
``forward`` put in place afterwards shadows the class's and is never let through). On a user
class every extra attribute counts: its ``forward`` may read what its parent set after
construction. The symbolic front end keeps a ``torch.nn`` module whole only when it can be
rebuilt (:func:`rebuild_problem`), else traces into it; ``auto`` prefers ``torch.export`` when
a module the symbolic graph keeps whole cannot be rebuilt; codegen checks the expression it
writes once more (:mod:`fxpipe.codegen.render.leaf_constructors`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import types
from typing import Any

import torch
import torch.nn as nn

from fxpipe.tracer.construct.construction import CtorArgs

__all__ = [
    "FOREIGN_MARKERS",
    "NotRebuildable",
    "is_torch_nn",
    "torch_nn_arguments",
    "drop_redundant",
    "build_on_meta",
    "configuration_difference",
    "rebuild_problem",
    "literal_problem",
]

# attributes every nn.Module has: bookkeeping compared by its own rules (state, hooks, submodules) or not at all
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module()))
_HOOK_TABLES = tuple(
    sorted(k for k in _MODULE_BOOKKEEPING if "hook" in k and k != "_is_full_backward_hook")
)
# attributes that libraries set on every module after construction and that no forward reads
FOREIGN_MARKERS = frozenset(
    {"_is_hf_initialized"}
)  # transformers' "weights already initialised" flag
_MAX_DEPTH = 8  # nesting of plain objects compared by their attributes


class NotRebuildable(Exception):
    """The module cannot be rebuilt from what is known about it; the message says why."""


def is_torch_nn(module: nn.Module) -> bool:
    """Whether the module's class comes from ``torch.nn`` (or ``torch.ao.nn``): rebuilt from hyperparameters."""
    name = type(module).__module__
    return name.startswith("torch.nn.") or name.startswith("torch.ao.nn.")


def torch_nn_arguments(module: nn.Module) -> CtorArgs:
    """The ``(args, kwargs)`` that rebuild a ``torch.nn`` layer, each ``__init__`` parameter read from the
    same-named attribute (``bias``-like flags whose attribute holds a tensor or ``None`` become
    ``attr is not None``; ``device`` is left out, ``dtype`` given only when the parameters are not the
    default dtype). Parameters the layer does not store keep their defaults; whether that rebuilds the
    same layer is for :func:`configuration_difference` to say. Raises :class:`NotRebuildable`."""
    cls = type(module)
    sig = inspect.signature(cls.__init__)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    dtypes = {t.dtype for t in module.parameters(recurse=True)} or {torch.get_default_dtype()}
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name == "device" or name.startswith("_"):
            continue
        if name == "dtype":
            if dtypes != {torch.get_default_dtype()} and len(dtypes) == 1:
                kwargs["dtype"] = next(iter(dtypes))
            continue
        has_default = p.default is not inspect.Parameter.empty
        if not _stores(module, name):
            if has_default:
                continue
            raise NotRebuildable(f"its __init__ argument {name!r} is not stored on the module")
        value = getattr(module, name)
        if isinstance(value, torch.Tensor) or (value is None and isinstance(p.default, bool)):
            value = value is not None
        if isinstance(value, (nn.Module, torch.Tensor)):
            raise NotRebuildable(
                f"its __init__ argument {name!r} is a {type(value).__name__}, not a hyperparameter"
            )
        if not has_default and p.kind is p.POSITIONAL_OR_KEYWORD and not kwargs:
            args.append(value)
        elif not has_default or not _same_value(value, p.default, 0):
            kwargs[name] = value
    return tuple(args), kwargs


def _stores(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is a value the module holds (an attribute, parameter, buffer, submodule or
    property), not one of its methods (``ModuleList(modules=...)`` against ``Module.modules``)."""
    if (
        name in vars(module)
        or name in module._parameters
        or name in module._buffers
        or name in module._modules
    ):
        return True
    return isinstance(inspect.getattr_static(type(module), name, None), property)


def build_on_meta(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> nn.Module:
    """``cls(*args, **kwargs)`` with its tensors on the meta device (no memory, no initialisation cost)."""
    with torch.device("meta"):
        return cls(*args, **kwargs)


def drop_redundant(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CtorArgs:
    """Leave out keywords whose default rebuilds the same module (``dilation=(1, 1)`` is ``1``),
    judged by the whole configuration (Note [rebuilt modules equal the original])."""
    defaults = inspect.signature(type(module).__init__).parameters
    for name in list(kwargs):
        if (
            name == "dtype"
            or name not in defaults
            or defaults[name].default is inspect.Parameter.empty
        ):
            continue
        trial = {k: v for k, v in kwargs.items() if k != name}
        try:
            rebuilt = build_on_meta(type(module), args, trial)
        except Exception:  # noqa: BLE001 - the keyword is needed
            continue
        if configuration_difference(module, rebuilt) is None:
            kwargs = trial
    return args, kwargs


def rebuild_problem(module: nn.Module, ctor_args: CtorArgs | None = None) -> str | None:
    """Why ``module`` cannot be rebuilt in a stage file (None when it can): a ``torch.nn`` layer from its
    hyperparameters, another class from ``ctor_args`` (its recorded constructor arguments)."""
    if is_torch_nn(module):
        try:
            args, kwargs = torch_nn_arguments(module)
        except NotRebuildable as exc:
            return str(exc)
    elif ctor_args is None:
        return "no constructor arguments were recorded for it"
    else:
        args, kwargs = tuple(ctor_args[0]), dict(ctor_args[1])
    problem = literal_problem((args, kwargs))
    if problem is not None:
        return f"its constructor argument {problem} cannot be written in a stage file"
    try:
        rebuilt = build_on_meta(type(module), args, kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot be rebuilt
        return f"rebuilding it failed: {type(exc).__name__}: {exc}"
    try:
        return configuration_difference(module, rebuilt)
    except Exception as exc:  # noqa: BLE001 - a configuration that cannot be compared is not known to be equal
        return f"comparing its configuration failed: {type(exc).__name__}: {exc}"


def literal_problem(value: Any) -> str | None:
    """The first part of ``value`` that has no Python literal form in a stage file (None when all have):
    ``None``, bools, numbers, strings, bytes, dtypes, devices, enums, tuples, lists, dicts, dataclasses."""
    if value is None or isinstance(
        value, (bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)
    ):
        return None
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return next((p for p in map(literal_problem, value) if p is not None), None)
    if isinstance(value, dict):
        return next(
            (p for p in map(literal_problem, [*value.keys(), *value.values()]) if p is not None),
            None,
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return next(
            (
                p
                for f in dataclasses.fields(value)
                if f.init
                for p in [literal_problem(getattr(value, f.name))]
                if p is not None
            ),
            None,
        )
    return f"{type(value).__name__} {_short_repr(value)}"


# ---- comparing configurations --------------------------------------------------------------------------------------


def configuration_difference(original: nn.Module, rebuilt: nn.Module, path: str = "") -> str | None:
    """The first way ``rebuilt`` differs from ``original`` in its configuration, or None when it equals it
    (Note [rebuilt modules equal the original]). Tensor values are not compared: they are the weights."""
    where = f" of {path!r}" if path else ""
    if type(original) is not type(rebuilt):
        return f"class{where}: {type(rebuilt).__name__}, expected {type(original).__name__}"
    want, got = _configuration(original), _configuration(rebuilt)
    for name in sorted(set(want) | set(got)):
        if name not in got and _ignorable_extra(original, name):
            continue
        if name not in want or name not in got:
            return f"attribute {_join(path, name)} is {'missing' if name not in got else 'extra'}"
        if not _same_value(want[name], got[name], 0):
            return f"{_join(path, name)} = {_short_repr(got[name])}, expected {_short_repr(want[name])}"
    state_want, state_got = _state(original), _state(rebuilt)
    if state_want != state_got:
        first = sorted(set(state_want) ^ set(state_got))[0]
        return f"parameters or buffers{where} differ (first: {first})"
    if original.extra_repr() != rebuilt.extra_repr():
        return f"extra_repr(){where} = {rebuilt.extra_repr()!r}, expected {original.extra_repr()!r}"
    hooks_want, hooks_got = _hooks(original), _hooks(rebuilt)
    if hooks_want != hooks_got:
        return f"hooks{where}: {hooks_got or 'none'}, expected {hooks_want or 'none'}"
    if list(original._modules) != list(rebuilt._modules):
        return f"submodules{where}: {list(rebuilt._modules)}, expected {list(original._modules)}"
    for name, child in original._modules.items():
        other = rebuilt._modules[name]
        if child is None or other is None:
            if child is not other:
                return f"submodule {_join(path, name)} is {'None' if other is None else 'set'}"
            continue
        problem = configuration_difference(child, other, _join(path, name))
        if problem is not None:
            return problem
    return None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _ignorable_extra(original: nn.Module, name: str) -> bool:
    """Whether an attribute the original has and its rebuilt copy lacks cannot change what it computes:
    a marker frameworks put on every module (``FOREIGN_MARKERS``), or, on a ``torch.nn`` layer, any
    attribute that is neither set by its ``__init__`` nor shadows something of its class (torch's
    ``forward`` reads only those; an instance ``forward`` put in place later is never ignored)."""
    if name in FOREIGN_MARKERS:
        return True
    return is_torch_nn(original) and inspect.getattr_static(type(original), name, None) is None


def _configuration(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k not in _MODULE_BOOKKEEPING}


def _state(module: nn.Module) -> list[tuple[str, str, str, bool]]:
    """(kind, name, shape and dtype or None, persistent) of the module's own parameters and buffers."""

    def spec(t: torch.Tensor | None) -> str:
        return "None" if t is None else f"{t.dtype}{list(t.shape)}"

    rows = [("parameter", k, spec(v), True) for k, v in module._parameters.items()]
    rows += [
        ("buffer", k, spec(v), k not in module._non_persistent_buffers_set)
        for k, v in module._buffers.items()
    ]
    return sorted(rows)


def _hooks(module: nn.Module) -> list[tuple[str, str]]:
    """The module's own hooks (its class's, registered by ``__init__``, or added afterwards), by function name."""
    found = []
    for table in _HOOK_TABLES:
        for hook in getattr(module, table, {}).values():
            fn = getattr(hook, "__func__", hook)
            found.append(
                (
                    table,
                    f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}",
                )
            )
    return sorted(found)


def _same_value(a: Any, b: Any, depth: int) -> bool:
    """Whether two configuration values are equal: by value, containers item by item, functions and classes
    by identity, modules by configuration, other objects by ``==`` or else by their attributes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype
    if isinstance(a, nn.Module):
        return configuration_difference(a, b) is None
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, types.MethodType):  # bound to the module itself, or to the same object
        return a.__func__ is b.__func__ and (
            a.__self__ is b.__self__ or type(a.__self__) is type(b.__self__)
        )
    if isinstance(a, (types.FunctionType, types.BuiltinFunctionType, type)):
        return a is b
    if isinstance(a, functools.partial):
        return a.func is b.func and _same_value(
            (a.args, a.keywords), (b.args, b.keywords), depth + 1
        )
    if type(a).__eq__ is not object.__eq__:
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - an __eq__ that does not give a bool
            return False
    if depth < _MAX_DEPTH and hasattr(a, "__dict__"):
        return _same_value(vars(a), vars(b), depth + 1)
    return a is b


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
