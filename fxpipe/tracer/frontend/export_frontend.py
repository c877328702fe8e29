"""Export front end: ``torch.export`` (non-strict, dynamic batch) to the normalized graph.

Lifted parameters, buffers and constants are mapped through ``ep.graph_signature``
(never by position) back to ``get_attr`` nodes under their original names; tensors
created in forward become ``_fxpipe_const_<i>`` attributes, and together with the
model's non-persistent buffers they are listed in ``meta[CONSTANTS_KEY]``. Buffer
mutations (BatchNorm running statistics) become explicit ``aten.copy_`` nodes.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn as nn
from torch.export import Dim, export
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind

from fxpipe.errors import TraceError
from fxpipe.graphmeta import CONSTANTS_KEY, DIM_RANGES_KEY, LIFTED_CONSTANT_PREFIX
from fxpipe.model_inputs import parse_model_inputs
from fxpipe.tracer.call import active_call, bind_example
from fxpipe.tracer.frontend.data_checks import export_with_checks
from fxpipe.tracer.dynamic import (
    DynamicDims,
    deferred_guard_note,
    export_dims,
    specialised_error,
    unproven_guard,
)
from fxpipe.tracer.frontend.fake_kernels import register_fake_kernels
from fxpipe.tracer.frontend.host_masks import host_masks_lifted
from fxpipe.tracer.frontend.host_random import numpy_draws, refuse_numpy_draws

__all__ = ["export_graph", "non_persistent_buffers", "infer_dynamic_dims"]


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """Fully-qualified names of the buffers left out of ``model.state_dict()``."""
    names = set()
    for path, module in model.named_modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{path}.{name}" if path else name)
    return names


def export_graph(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    batch_dims: Sequence[int | None] | None = None,
    dynamic_dims: DynamicDims | None = None,
) -> torch.fx.GraphModule:
    """Export ``model`` with a dynamic batch dimension and return the normalized-form graph.

    ``example_inputs`` are the tensor inputs: of the call being traced (``active_call``,
    Note [the traced call] in ``fxpipe.tracer.call``: keyword arguments and constants go to
    ``torch.export`` as they were given), else positional arguments. ``batch_dims`` names
    each input's batch dimension (``None``: static input); the default is dim 0 of every
    non-scalar input. ``dynamic_dims``: the other dynamic dimensions (Note [dynamic
    dimensions] in :mod:`fxpipe.tracer.dynamic`); the range export holds each for is in
    ``meta[DIM_RANGES_KEY]``. The graph's placeholders are the tensor inputs only (export's
    placeholders of constant arguments are dropped). The output node still returns the
    exported (already flat) user outputs; the caller finishes normalization (paths,
    output spec, getitems).
    """
    dims = (
        tuple(0 if t.dim() > 0 else None for t in example_inputs)
        if batch_dims is None
        else batch_dims
    )
    dynamic_dims = dynamic_dims or tuple({} for _ in example_inputs)
    shapes = export_dims(dims, dynamic_dims)
    call = active_call(len(example_inputs))
    bound: dict[str, Any] = {}
    if call is None:
        args: tuple[Any, ...] = tuple(example_inputs)
        kwargs: dict[str, Any] = {}
        dynamic: Any = tuple(shapes)
    else:
        args, kwargs, dynamic, bound = call.with_tensors(example_inputs).export_arguments(shapes)
    try:
        ep = _export(model, args, kwargs, dynamic, bound)
    except Exception as exc:
        specialised = specialised_error(exc, dynamic_dims)
        if specialised is None:
            raise
        if not unproven_guard(exc):
            raise specialised from exc
        try:  # Note [guards export cannot prove]
            ep = _export(model, args, kwargs, dynamic, bound, deferred=True)
        except Exception:
            raise specialised from exc
        warnings.warn(f"fxpipe: {deferred_guard_note(exc)}", stacklevel=2)
    sig = ep.graph_signature
    kinds = {spec.arg.name: spec for spec in sig.input_specs}
    graph = torch.fx.Graph()
    root: dict[str, Any] = {}
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    constants: set[str] = set()
    non_persistent = non_persistent_buffers(model)
    const_names: dict[str, str] = {}

    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder":
            spec = kinds[node.name]
            if spec.kind == InputKind.USER_INPUT:
                if isinstance(
                    spec.arg, ConstantArgument
                ):  # specialized: checked against the CallSpec instead
                    if node.users:
                        raise TraceError(
                            f"torch.export kept the constant argument {spec.arg.name!r} as a graph input"
                        )
                    continue
                env[node] = graph.node_copy(node, lambda n: env[n])
                continue
            target = spec.target
            assert target is not None
            if spec.kind == InputKind.PARAMETER:
                root[target] = model.get_parameter(target)
            elif spec.kind == InputKind.BUFFER:
                root[target] = _model_attr(model, target, ep.constants)
                if not spec.persistent or target in non_persistent:
                    constants.add(target)
            else:  # lifted tensor constant (or custom object)
                value = ep.constants[target]
                if not _has_attr(model, target):
                    target = const_names.setdefault(
                        target, f"{LIFTED_CONSTANT_PREFIX}{len(const_names)}"
                    )
                root[target] = value
                constants.add(target)
            new = graph.get_attr(target)
            new.meta.update(node.meta)
            env[node] = new
        elif node.op == "get_attr":
            root[str(node.target)] = getattr(ep.graph_module, str(node.target))
            env[node] = graph.node_copy(node, lambda n: env[n])
        elif node.op == "output":
            _emit_outputs(graph, node, sig, env, root)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])

    gm = torch.fx.GraphModule(root, graph, type(model).__name__)
    gm.meta[CONSTANTS_KEY] = constants
    gm.meta[DIM_RANGES_KEY] = _dim_ranges(ep, gm, dynamic_dims)
    return gm


def _export(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic: Any,
    bound: dict[str, Any],
    deferred: bool = False,
) -> Any:
    """``torch.export`` (non-strict), with ``bound`` given to ``forward`` through a ``functools.partial``
    for the duration (see ``BoundCall.export_arguments``); ``deferred``: guards become run-time
    asserts in the graph (Note [guards export cannot prove])."""
    register_fake_kernels()
    draws: list[tuple[str, int]] = []

    def run() -> Any:
        try:
            # Note [numpy random numbers], Note [masks drawn on the host]
            with numpy_draws(draws), host_masks_lifted():
                ep = export(
                    model,
                    args,
                    kwargs,
                    dynamic_shapes=dynamic,
                    strict=False,
                    prefer_deferred_runtime_asserts_over_guards=deferred,
                )
        except Exception as exc:  # a numpy draw is the cause to report (it may fix the batch too)
            if draws:
                refuse_numpy_draws(type(model).__name__, draws)
            raise exc
        refuse_numpy_draws(type(model).__name__, draws)
        return ep

    if not bound:
        return export_with_checks(run)[0]  # Note [checks on data]
    model.forward = functools.partial(model.forward, **bound)
    try:
        return export_with_checks(run)[0]
    finally:
        del model.forward


def _emit_outputs(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    sig: Any,
    env: dict[torch.fx.Node, torch.fx.Node],
    root: dict[str, Any],
) -> None:
    user_outputs = []
    returned = node.args[0]
    assert isinstance(returned, (tuple, list)), (
        "an exported graph returns a flat sequence of values"
    )
    for spec, value in zip(sig.output_specs, returned):
        if spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(env[value])
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            buffer = graph.get_attr(spec.target)
            graph.call_function(torch.ops.aten.copy_.default, (buffer, env[value]))
        else:
            raise NotImplementedError(f"fxpipe cannot yet handle exported output kind {spec.kind}")
    graph.output(tuple(user_outputs))


def _has_attr(model: nn.Module, target: str) -> bool:
    try:
        owner = model.get_submodule(target.rpartition(".")[0])
    except AttributeError:
        return False
    return hasattr(owner, target.rpartition(".")[2])


def _model_attr(model: nn.Module, target: str, constants: dict[str, Any]) -> Any:
    if _has_attr(model, target):
        owner = model.get_submodule(target.rpartition(".")[0])
        return getattr(owner, target.rpartition(".")[2])
    return constants[target]


def _dim_ranges(
    ep: Any, gm: torch.fx.GraphModule, dynamic: DynamicDims
) -> dict[str, tuple[int, int | None]]:
    """The range export holds each declared symbol for (its ``range_constraints``)."""
    out: dict[str, tuple[int, int | None]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, dims in zip(placeholders, dynamic):
        val = node.meta.get("val")
        for d, (symbol, _, _) in dims.items():
            size = val.shape[d] if isinstance(val, torch.Tensor) else None
            if not isinstance(size, torch.SymInt):
                continue
            vr = ep.range_constraints.get(size.node.expr)
            if vr is None:
                continue
            out[symbol] = (_bound(vr.lower) or 0, _bound(vr.upper))
    return out


def infer_dynamic_dims(
    model: nn.Module, example: Any, batch_dims: Sequence[int | None]
) -> dict[str, dict[int, Any]]:
    """``--dynamic auto``: the input dimensions besides the batch that the model does not specialise.

    Every such dimension of every tensor input is offered to ``torch.export`` as ``Dim.AUTO``; those
    it kept symbolic are dynamic, named ``<input>_<dim>`` (equal ones share the first one's name), with
    the range export found (Note [dynamic dimensions] in :mod:`fxpipe.tracer.dynamic`)."""
    call = bind_example(model, parse_model_inputs(example))
    tensors = call.tensors
    batch = Dim("batch", min=1)
    shapes: list[dict[int, Any] | None] = []
    for t, b in zip(tensors, batch_dims):
        shape: dict[int, Any] = {d: Dim.AUTO for d in range(t.dim()) if d != b and t.shape[d] > 1}
        if b is not None:
            shape[b] = batch
        shapes.append(shape or None)
    args, kwargs, dynamic, bound = call.export_arguments(shapes)
    with torch.no_grad():
        ep = _export(model, args, kwargs, dynamic, bound)
    placeholders = [
        n
        for n, spec in zip(ep.graph.nodes, ep.graph_signature.input_specs)
        if spec.kind == InputKind.USER_INPUT and not isinstance(spec.arg, ConstantArgument)
    ]
    names: dict[Any, str] = {}
    out: dict[str, dict[int, Any]] = {}
    for name, node, b in zip(call.spec.inputs, placeholders, batch_dims):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if d == b or not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            symbol = names.setdefault(expr, f"{name}_{d}")
            vr = ep.range_constraints.get(expr)
            low = max(_bound(vr.lower) or 0, 2) if vr is not None else 2
            high = _bound(vr.upper) if vr is not None else None
            out.setdefault(name, {})[d] = (symbol, low, high)
    return out


def _bound(value: Any) -> int | None:
    """A range bound of export's as an int; ``None`` for infinity."""
    try:
        return int(value)
    except (OverflowError, TypeError, ValueError, AttributeError):
        return None
