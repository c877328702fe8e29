"""Symbolic front end: ``torch.fx`` tracing under a leaf policy with fallback to leaves.

Leaf policy: modules whose class lives in ``torch.nn`` (except ``Sequential``, as in
FX's default) are leaves when a stage file can rebuild them from their hyperparameters
(Note [rebuilt modules equal the original] in :mod:`fxpipe.tracer.construct.rebuild`; the others,
such as ``nn.TransformerEncoder``, are traced into), plus the types and paths a user
names. Augmented assignments and item assignments are recorded as what they are
(``a += b`` as ``operator.iadd``, ``a[i] = b`` as ``operator.setitem``: :class:`_InPlaceProxy`).
``torch._assert`` messages get back what the user wrote
(:mod:`fxpipe.tracer.frontend.assert_messages`). When tracing fails inside a submodule
(data-dependent control flow, shape arithmetic, unsupported calls), that submodule is
made a leaf and tracing starts over; the result lists each
such :class:`FallbackLeaf` (the caller warns once per cause, :func:`warn_fallbacks`).
A failure outside every submodule raises :class:`SymbolicTraceFailure`.
"""

from __future__ import annotations

import inspect
import operator
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.tracer.frontend.assert_messages import note_assert_site, restore_assert_messages
from fxpipe.tracer.call import active_call
from fxpipe.tracer.construct.rebuild import rebuild_problem

__all__ = [
    "LeafSpec",
    "SymbolicTraceFailure",
    "SymbolicResult",
    "FallbackLeaf",
    "symbolic_trace",
    "is_torch_nn_leaf",
    "warn_fallbacks",
]

LeafSpec = type | str  # a module class, or a module path


class SymbolicTraceFailure(Exception):
    """Symbolic tracing failed at the top level of the model (``path == ""``)."""

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        self.cause = cause
        where = f"module {path!r}" if path else "the model's own forward"
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class FallbackLeaf:
    """A submodule kept whole because tracing into it failed, and where in the user's code it failed."""

    path: str
    module_type: str
    reason: str
    filename: str
    lineno: int


@dataclass(frozen=True)
class SymbolicResult:
    """A traced graph and which leaves were added because tracing into them failed."""

    graph_module: torch.fx.GraphModule
    fallbacks: tuple[FallbackLeaf, ...] = ()

    @property
    def fallback_leaves(self) -> dict[str, str]:
        """Module path -> why it was kept whole."""
        return {f.path: f.reason for f in self.fallbacks}


def _failure_site(module: nn.Module, cause: BaseException) -> tuple[str, int]:
    """The line of the module's own source where tracing failed (its class definition when the
    traceback never reaches that file), so a warning points at the user's code."""
    cls = type(module)
    try:
        filename = inspect.getsourcefile(cls) or "<unknown>"
    except TypeError:
        return "<unknown>", 0
    site = None
    for frame, lineno in traceback.walk_tb(cause.__traceback__):
        if frame.f_code.co_filename == filename:
            site = (filename, lineno)
    if site is None:
        try:
            site = (filename, inspect.getsourcelines(cls)[1])
        except (OSError, TypeError):
            site = (filename, 0)
    return site


def warn_fallbacks(fallbacks: Iterable[FallbackLeaf]) -> None:
    """One ``UserWarning`` per module class and cause, listing every path kept whole, attributed to
    the line of the user's code where tracing failed (not to fxpipe)."""
    groups: dict[tuple[str, str, str, int], list[str]] = {}
    for f in fallbacks:
        groups.setdefault((f.module_type, f.reason, f.filename, f.lineno), []).append(f.path)
    for (module_type, reason, filename, lineno), paths in groups.items():
        shown = ", ".join(repr(p) for p in paths[:4]) + (
            f" and {len(paths) - 4} more" if len(paths) > 4 else ""
        )
        them = "them" if len(paths) > 1 else "it"
        warnings.warn_explicit(
            f"fxpipe: symbolic tracing failed inside {shown} ({module_type}): {reason}; keeping {them} whole as "
            f"leaf module{'s' if len(paths) > 1 else ''} (--frontend export traces into {them})",
            UserWarning,
            filename,
            lineno,
            module=module_type,
        )


def is_torch_nn_leaf(module: nn.Module) -> bool:
    """FX's default leaf rule: a ``torch.nn`` (or ``torch.ao.nn``) class that is not ``Sequential``."""
    mod = type(module).__module__
    return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(
        module, nn.Sequential
    )


class _SubmoduleFailure(Exception):
    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(path)
        self.path = path
        self.cause = cause


class _InPlaceProxy(torch.fx.Proxy):
    """A Proxy that records ``a += b`` as ``operator.iadd(a, b)`` and ``a[i] = b`` as ``operator.setitem``.

    FX's own Proxy has neither: Python falls back to ``a = a + b``, a new tensor where the
    program changed ``a`` (and every alias of it, such as a residual kept as ``identity = a``),
    and item assignment fails the trace. Recorded as calls, they run as the program ran, and
    the in-place analysis sees them (Note [in-place ops across stages] in :mod:`fxpipe.tracer.frontend.mutation`).
    """

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})


def _augmented(op: Any) -> Any:
    def method(self: torch.fx.Proxy, other: Any) -> torch.fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _name in (
    "iadd",
    "isub",
    "imul",
    "itruediv",
    "ifloordiv",
    "imod",
    "ipow",
    "imatmul",
    "iand",
    "ior",
    "ixor",
    "ilshift",
    "irshift",
):
    setattr(_InPlaceProxy, f"__{_name}__", _augmented(getattr(operator, _name)))


class _LeafTracer(torch.fx.Tracer):
    """A Tracer that keeps the chosen modules whole and reports the innermost failing one."""

    def __init__(
        self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str], rebuildable: dict[int, bool]
    ) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.rebuildable = (
            rebuildable  # id(module) -> whether it is a torch.nn layer a stage can rebuild
        )

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or isinstance(m, self.leaf_types):
            return True
        return self.rebuildable.get(id(m), False)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _InPlaceProxy(node, self)

    def create_node(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any = None,
    ) -> torch.fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        note_assert_site(node)
        return node

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _SubmoduleFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - any tracing error makes this module a leaf
            raise _SubmoduleFailure(path, exc) from exc


def _concrete_args(
    model: nn.Module, n_inputs: int
) -> tuple[dict[str, Any], frozenset[str], tuple[str | None, ...] | None]:
    """FX's ``concrete_args`` for the call being traced (Note [the traced call] in
    ``fxpipe.tracer.call``), the names of the tensor inputs, and, for a call with containers of
    tensors, the name each of FX's placeholders is to get (``None``: a constant's, dropped);
    outside ``trace_model``, the first ``n_inputs`` parameters are the inputs and the others keep
    their defaults."""
    call = active_call(n_inputs)
    if call is not None:
        if not call.symbolic:
            trees = _tree_concrete(call)
            if trees is None:
                raise SymbolicTraceFailure(
                    "",
                    TypeError(
                        "arguments passed through *args or **kwargs cannot be traced symbolically"
                    ),
                )
            concrete, names = trees
            return concrete, frozenset(call.spec.inputs), names
        return dict(call.concrete), frozenset(call.spec.inputs), None
    params = [
        p
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    extra = {p.name: p.default for p in params[n_inputs:] if p.default is not p.empty}
    return extra, frozenset(p.name for p in params[:n_inputs]), None


def _tree_concrete(call: Any) -> tuple[dict[str, Any], tuple[str | None, ...]] | None:
    """Note [containers through FX]: FX takes a container argument as ``concrete_args`` whose
    tensor leaves are ``PH``: one placeholder per leaf, in pytree's order, which is the order
    of the call's tensor inputs (``bind_example``); a constant leaf gets a placeholder too, used
    by FX's check of its value only, and dropped with it. The concrete arguments and, per
    placeholder FX makes, the tensor input it is (``None`` for a constant's); ``None`` when the
    call passes anything through ``*args`` / ``**kwargs``, which FX cannot trace."""
    from torch.fx._symbolic_trace import PH

    bound = call.signature.bind(*call.example.args, **call.example.kwargs)
    trees = {tree.name: tree for tree in call.spec.trees}
    concrete: dict[str, Any] = {}
    names: list[str | None] = []
    for name, p in call.signature.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if bound.arguments.get(name):
                return None
            continue
        if name in trees:
            value = bound.arguments[name]
            concrete[name] = pytree.tree_map(
                lambda x: PH if isinstance(x, torch.Tensor) else x, value
            )
            names += list(trees[name].inputs)
        elif name in call.concrete:
            concrete[name] = call.concrete[name]
            names.append(None)
        else:
            names.append(name)
    return concrete, tuple(names)


def _name_tree_placeholders(graph: torch.fx.Graph, names: tuple[str | None, ...]) -> None:
    """Give FX's placeholders of container leaves the names of the call's tensor inputs
    (``batch_1`` -> ``batch_image``) and take back FX's pytree calling convention: the graph
    takes its tensor inputs flat, as every graph of the normalized form does (Note [containers
    through FX])."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        raise SymbolicTraceFailure(
            "",
            TypeError(
                f"FX made {len(placeholders)} inputs for a call of {len(names)} arguments and "
                "container leaves"
            ),
        )
    for node, name in zip(placeholders, names):
        if name is not None and node.target != name:
            node.target = name
            node._rename(name)
    graph._codegen = torch.fx.graph.CodeGen()


_CHECKS = (torch.fx._symbolic_trace._assert_is_none, torch._assert, operator.eq)


def _drop_concrete_placeholders(gm: torch.fx.GraphModule, inputs: frozenset[str]) -> None:
    """Remove the placeholders FX makes for ``concrete_args`` and the checks it attaches to them
    (the call is checked against the build's ``CallSpec`` instead)."""
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.target not in inputs]:
        users, frontier = [], list(node.users)
        while frontier:
            user = frontier.pop()
            if user.op != "call_function" or user.target not in _CHECKS:
                raise SymbolicTraceFailure(
                    "", TypeError(f"the graph uses the constant argument {node.target!r}")
                )
            users.append(user)
            frontier += user.users
        order = {n: i for i, n in enumerate(graph.nodes)}
        for user in sorted(set(users), key=order.__getitem__, reverse=True):
            graph.erase_node(user)
        graph.erase_node(node)
    gm.recompile()


def symbolic_trace(
    model: nn.Module, n_inputs: int, leaves: Iterable[LeafSpec] = ()
) -> SymbolicResult:
    """Trace ``model`` with FX, making failing submodules leaves (listed in the result, not warned here).

    Raises :class:`SymbolicTraceFailure` when the failure is in the model's own forward.
    """
    leaves = tuple(leaves)
    leaf_types = tuple(x for x in leaves if isinstance(x, type))
    leaf_paths = {x for x in leaves if isinstance(x, str)}
    fallbacks: list[FallbackLeaf] = []
    concrete, inputs, tree_names = _concrete_args(model, n_inputs)
    # decided before tracing: while the tracer runs, a module's parameters read as Proxies
    rebuildable = {
        id(m): rebuild_problem(m) is None for m in model.modules() if is_torch_nn_leaf(m)
    }
    for _ in range(sum(1 for _ in model.modules()) + 1):
        tracer = _LeafTracer(leaf_types, frozenset(leaf_paths), rebuildable)
        try:
            with warnings.catch_warnings():  # FX cannot check object constants; the CallSpec does
                warnings.filterwarnings("ignore", "Was not able to add assertion")
                graph = tracer.trace(model, concrete_args=concrete or None)
        except _SubmoduleFailure as failure:
            module = model.get_submodule(failure.path)
            reason = f"{type(failure.cause).__name__}: {failure.cause}"
            fallbacks.append(
                FallbackLeaf(
                    failure.path,
                    type(module).__name__,
                    reason,
                    *_failure_site(module, failure.cause),
                )
            )
            leaf_paths.add(failure.path)
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the caller with the cause
            raise SymbolicTraceFailure("", exc) from exc
        restore_assert_messages(graph)
        if tree_names is not None:
            _name_tree_placeholders(graph, tree_names)
        gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
        _drop_concrete_placeholders(gm, inputs)
        return SymbolicResult(gm, tuple(fallbacks))
    raise SymbolicTraceFailure("", RuntimeError("fallback to leaves did not converge"))
