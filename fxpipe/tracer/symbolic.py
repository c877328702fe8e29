"""Symbolic front end: ``torch.fx`` tracing under a leaf policy with fallback to leaves.

Leaf policy: modules whose class lives in ``torch.nn`` (except ``Sequential``, as in
FX's default) are leaves, plus the types and paths a user names. When tracing fails
inside a submodule (data-dependent control flow, shape arithmetic, unsupported
calls), that submodule is made a leaf, a warning names it, and tracing starts over.
A failure outside every submodule raises :class:`SymbolicTraceFailure`.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx
import torch.nn as nn

__all__ = ["LeafSpec", "SymbolicTraceFailure", "SymbolicResult", "symbolic_trace", "is_torch_nn_leaf"]

LeafSpec = type | str  # a module class, or a module path


class SymbolicTraceFailure(Exception):
    """Symbolic tracing failed at the top level of the model (``path == ""``)."""

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        self.cause = cause
        where = f"module {path!r}" if path else "the model's own forward"
        super().__init__(f"{where}: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class SymbolicResult:
    """A traced graph and which leaves were added because tracing into them failed."""

    graph_module: torch.fx.GraphModule
    fallback_leaves: dict[str, str]  # path -> reason


def is_torch_nn_leaf(module: nn.Module) -> bool:
    """FX's default leaf rule: a ``torch.nn`` (or ``torch.ao.nn``) class that is not ``Sequential``."""
    mod = type(module).__module__
    return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(module, nn.Sequential)


class _SubmoduleFailure(Exception):
    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(path)
        self.path = path
        self.cause = cause


class _LeafTracer(torch.fx.Tracer):
    """A Tracer that keeps the chosen modules whole and reports the innermost failing one."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_paths: frozenset[str]) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (module_qualified_name in self.leaf_paths or isinstance(m, self.leaf_types)
                or is_torch_nn_leaf(m))

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            return super().call_module(m, forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except _SubmoduleFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - any tracing error makes this module a leaf
            raise _SubmoduleFailure(path, exc) from exc


def _concrete_defaults(model: nn.Module, n_inputs: int) -> dict[str, Any] | None:
    """Bind forward parameters beyond the positional inputs to their defaults."""
    params = list(inspect.signature(model.forward).parameters.values())
    extra = {p.name: p.default for p in params[n_inputs:]
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty}
    return extra or None


def symbolic_trace(model: nn.Module, n_inputs: int, leaves: Iterable[LeafSpec] = ()) -> SymbolicResult:
    """Trace ``model`` with FX, making failing submodules leaves (each with a warning).

    Raises :class:`SymbolicTraceFailure` when the failure is in the model's own forward.
    """
    leaves = tuple(leaves)
    leaf_types = tuple(x for x in leaves if isinstance(x, type))
    leaf_paths = {x for x in leaves if isinstance(x, str)}
    fallback: dict[str, str] = {}
    concrete = _concrete_defaults(model, n_inputs)
    for _ in range(sum(1 for _ in model.modules()) + 1):
        tracer = _LeafTracer(leaf_types, frozenset(leaf_paths))
        try:
            graph = tracer.trace(model, concrete_args=concrete)
        except _SubmoduleFailure as failure:
            reason = f"{type(failure.cause).__name__}: {failure.cause}"
            warnings.warn(
                f"fxpipe: symbolic tracing failed inside {failure.path!r} "
                f"({type(model.get_submodule(failure.path)).__name__}): {reason}; keeping it whole as a leaf module",
                stacklevel=3,
            )
            fallback[failure.path] = reason
            leaf_paths.add(failure.path)
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the caller with the cause
            raise SymbolicTraceFailure("", exc) from exc
        gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
        return SymbolicResult(gm, fallback)
    raise SymbolicTraceFailure("", RuntimeError("fallback to leaves did not converge"))
