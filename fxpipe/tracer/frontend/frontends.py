"""Choosing a front end: symbolic FX when it shows the model's structure, else ``torch.export``.

``auto`` takes the symbolic graph unless tracing failed in the model's own forward, the
submodules it had to keep whole as leaves hold more than ``MAX_FALLBACK_PARAM_SHARE`` of the
parameters (then the partitioner would see too little structure, e.g. HF GPT-2 collapses to
one ``transformer`` leaf), or a module it keeps whole cannot be rebuilt in a stage file
(Note [rebuilt modules equal the original] in :mod:`fxpipe.tracer.construct.rebuild`: a ``torch.nn``
layer from its hyperparameters, a user class from its recorded constructor arguments; e.g.
``nn.TransformerEncoder``, whose layers fail symbolic tracing and whose ``__init__`` takes a
module). Only when both fail is a :class:`TraceError` raised.
"""

from __future__ import annotations

import linecache
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
import torch.fx
import torch.nn as nn

from fxpipe.errors import TraceError
from fxpipe.tracer.construct.construction import CtorArgs
from fxpipe.tracer.frontend.data_checks import DataBranch, is_data_dependent, user_site
from fxpipe.tracer.frontend.export_frontend import export_graph, non_persistent_buffers
from fxpipe.tracer.construct.rebuild import is_torch_nn, rebuild_problem
from fxpipe.tracer.frontend.static_batch import (
    Specialisation,
    batch_was_fixed,
    fixed_batch,
    recording,
)
from fxpipe.tracer.dynamic import DynamicDims, SpecialisedError
from fxpipe.tracer.measure.shapes import BatchDims, batch_size_of, double_batch
from fxpipe.tracer.frontend.symbolic import (
    FallbackLeaf,
    LeafSpec,
    SymbolicTraceFailure,
    symbolic_trace,
    warn_fallbacks,
)
from fxpipe.tracer.trace_options import (
    FRONTENDS,
)  # declared with the --frontend flag, which imports no torch
from fxpipe.graphmeta import CONSTANTS_KEY

__all__ = [
    "FRONTENDS",
    "MAX_FALLBACK_PARAM_SHARE",
    "FrontendResult",
    "trace_graph",
    "unrebuildable_leaves",
]

MAX_FALLBACK_PARAM_SHARE = 0.5


@dataclass(frozen=True)
class FrontendResult:
    graph_module: torch.fx.GraphModule
    frontend: str
    fallbacks: tuple[FallbackLeaf, ...] = ()
    static_batch: str = (
        ""  # the line that fixes the batch: traced static (Note [a batch the model fixes])
    )

    @property
    def fallback_leaves(self) -> dict[str, str]:
        """Module path -> why the symbolic front end kept it whole."""
        return {f.path: f.reason for f in self.fallbacks}

    def warn(self) -> FrontendResult:
        """Warn about the modules kept whole (once per class and cause) and return self."""
        warn_fallbacks(self.fallbacks)
        return self


def _param_share(model: nn.Module, paths: Iterable[str]) -> float:
    total = sum(p.numel() for p in model.parameters())
    inside = {id(p): p.numel() for path in paths for p in model.get_submodule(path).parameters()}
    return sum(inside.values()) / total if total else 0.0


def _symbolic(model: nn.Module, n_inputs: int, leaves: tuple[LeafSpec, ...]) -> FrontendResult:
    result = symbolic_trace(
        model, n_inputs, leaves
    )  # its fallbacks are warned only if this graph is used
    gm = result.graph_module
    non_persistent = non_persistent_buffers(model)
    gm.meta[CONSTANTS_KEY] = {
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr" and str(n.target) in non_persistent
    }
    return FrontendResult(gm, "symbolic", result.fallbacks)


def unrebuildable_leaves(
    model: nn.Module, gm: torch.fx.GraphModule, ctor_args: Mapping[str, CtorArgs] | None
) -> dict[str, str]:
    """Module path -> why a stage file could not rebuild it, for each module the graph keeps whole.
    User classes are judged only when ``ctor_args`` (the recorded constructor arguments) is given."""
    problems: dict[str, str] = {}
    for path in dict.fromkeys(str(n.target) for n in gm.graph.nodes if n.op == "call_module"):
        module = model.get_submodule(path)
        if not is_torch_nn(module) and ctor_args is None:
            continue
        problem = rebuild_problem(module, (ctor_args or {}).get(path))
        if problem is not None:
            problems[path] = f"{type(module).__name__}: {problem}"
    return problems


def _export(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    batch_dims: BatchDims,
    dynamic_dims: DynamicDims | None,
) -> FrontendResult:
    # a batch of 1 would be specialised by export; the same samples twice are not
    if all(d is None for d in batch_dims):  # static (Note [a batch the model fixes])
        return FrontendResult(export_graph(model, inputs, batch_dims, dynamic_dims), "export")
    given, batch = inputs, batch_size_of(inputs, batch_dims)
    if batch == 1:
        inputs = double_batch(inputs, batch_dims)
    found: list[Specialisation] = []
    try:
        with recording(found):
            return FrontendResult(export_graph(model, inputs, batch_dims, dynamic_dims), "export")
    except Exception as exc:
        if not batch_was_fixed(exc):
            raise
    site = fixed_batch(found, batch_size_of(inputs, batch_dims))  # Note [a batch the model fixes]
    where = str(site) if site else "a line torch.export does not name"
    warnings.warn(
        f"fxpipe: {where} makes the batch size a constant, so the batch cannot be dynamic: traced "
        f"static at the microbatch size {batch}; every microbatch must hold {batch} samples",
        stacklevel=4,
    )
    static = export_graph(model, given, tuple(None for _ in given), dynamic_dims)
    return FrontendResult(static, "export", static_batch=where)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _site(exc: BaseException | None) -> str:
    """`` at file:line (`code`)`` of the innermost frame of the model's code in ``exc``'s traceback."""
    while exc is not None:
        if isinstance(exc, DataBranch):
            return ""  # its message names the line already
        site = user_site(exc.__traceback__)
        if site is not None:
            code = linecache.getline(*site).strip()
            return f" at {Path(site[0]).name}:{site[1]}" + (f" (`{code}`)" if code else "")
        exc = exc.__cause__
    return ""


def _advice(exported: BaseException | None) -> str:
    """What to try, for what torch.export hit (the front end that traces the most)."""
    if isinstance(exported, DataBranch) or (exported is not None and is_data_dependent(exported)):
        return (
            "try: make that branch a computation (torch.where, a mask), decide it outside forward "
            "(a constructor argument), or keep the submodule that holds it whole (--leaf "
            "path.to.module); a branch that only raises (`if ...: raise`) is kept as a runtime assert"
        )
    return (
        "try: make the failing line traceable (no Python control flow on tensor values), or keep "
        "the module that holds it whole (--leaf path.to.module / trace_model(..., leaves=[...]))"
    )


def _both_failed(
    model: nn.Module, symbolic: BaseException | None, exported: BaseException | None
) -> TraceError:
    tried = " and ".join(
        name
        for name, exc in (("symbolic FX", symbolic), ("torch.export", exported))
        if exc is not None
    )
    lines = [
        f"could not trace {type(model).__name__}: {tried} "
        + (
            "each stopped where the lines below say"
            if " and " in tried
            else "stopped where the line below says"
        )
    ]
    if symbolic is not None:
        cause = symbolic.cause if isinstance(symbolic, SymbolicTraceFailure) else symbolic
        lines.append(f"  symbolic (torch.fx): {_first_line(symbolic)}{_site(cause)}")
    if exported is not None:
        lines.append(
            f"  export (torch.export): {type(exported).__name__}: {_first_line(exported)}"
            f"{_site(exported)}"
        )
    lines.append(_advice(exported))
    return TraceError("\n".join(lines))


def trace_graph(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    frontend: str,
    leaves: tuple[LeafSpec, ...],
    batch_dims: BatchDims,
    ctor_args: Mapping[str, CtorArgs] | None = None,
    dynamic_dims: DynamicDims | None = None,
) -> FrontendResult:
    """Trace with the requested front end (see the module docstring for ``auto``).

    ``batch_dims`` (one per input, ``None`` = not batched) are the dimensions export keeps dynamic;
    ``ctor_args``: the recorded constructor arguments (module path -> ``(args, kwargs)``), None when
    the model was not built under :func:`~fxpipe.tracer.construct.record.build_model_recorded`.
    """
    if frontend not in FRONTENDS:
        raise TraceError(f"unknown front end {frontend!r}; expected one of {', '.join(FRONTENDS)}")
    symbolic_error: BaseException | None = None
    symbolic: FrontendResult | None = None
    if frontend in ("auto", "symbolic"):
        try:
            symbolic = _symbolic(model, len(inputs), leaves)
        except SymbolicTraceFailure as exc:
            if frontend == "symbolic":
                raise _both_failed(model, exc, None) from exc
            symbolic_error = exc
        unbuildable: dict[str, str] = {}
        if symbolic is not None:
            if frontend == "symbolic":
                return symbolic.warn()
            share = _param_share(model, symbolic.fallback_leaves)
            unbuildable = unrebuildable_leaves(model, symbolic.graph_module, ctor_args)
            if share <= MAX_FALLBACK_PARAM_SHARE and not unbuildable:
                return symbolic.warn()
            reason = (
                f"modules kept whole hold {share:.0%} of the parameters"
                if share > MAX_FALLBACK_PARAM_SHARE
                else "a module kept whole cannot be rebuilt in a stage file: "
                + "; ".join(f"{p!r} ({why})" for p, why in unbuildable.items())
            )
            symbolic_error = SymbolicTraceFailure(
                next(iter(unbuildable or symbolic.fallback_leaves)), RuntimeError(reason)
            )
    try:
        return _export(model, inputs, batch_dims, dynamic_dims)
    except SpecialisedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the message goes to the user
        if symbolic is not None:
            kept = ", ".join(repr(p) for p in unbuildable or symbolic.fallback_leaves)
            warnings.warn(
                f"fxpipe: torch.export failed ({type(exc).__name__}: {_first_line(exc)}); using the "
                f"symbolic graph, in which {kept} are kept whole"
                + (
                    " and cannot be rebuilt in a stage file, so partitioning will fail"
                    if unbuildable
                    else ""
                ),
                stacklevel=3,
            )
            return symbolic.warn()
        raise _both_failed(model, symbolic_error, exc) from exc
