"""``trace_model``: model + example inputs -> normalized graph, units and a ``ModelProfile``.

Steps: pick a front end (:mod:`fxpipe.tracer.frontend.frontends`), normalize the graph
(:mod:`fxpipe.tracer.frontend.normalize`), check it reproduces the model's output, propagate
shapes (:mod:`fxpipe.tracer.measure.shapes`), group units (:mod:`fxpipe.tracer.units`) and cost
them (:mod:`fxpipe.tracer.measure.counting`, :mod:`fxpipe.tracer.measure.timing`). The model's buffers and the RNG state are restored
afterwards, so tracing never changes the model (BatchNorm statistics included).

The model is traced in train mode (the profile is of training) and again in eval mode, and the
two graphs are merged into one that reads ``self.training`` where they differ
(:mod:`fxpipe.tracer.train_eval.bothmodes`); every submodule's mode is restored afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.errors import ModelFileError, TraceError
from fxpipe.modelfile import ModelSource
from fxpipe.tracer.call import (
    BoundCall,
    ModelInputs,
    bind_example,
    parse_model_inputs,
    tracing_call,
)
from fxpipe.tracer.measure.calibration import DEVICE_PRESETS
from fxpipe.tracer.measure.cost_scaling import unit_scalings
from fxpipe.tracer.measure.counting import UnitCounts, count_unit, count_units_once
from fxpipe.tracer.measure.device_memory import measure_memory_bytes
from fxpipe.tracer.progress import phase, progress_iter
from fxpipe.tracer.seeding import seeded
from fxpipe.tracer.measure.timing import analytic_ms, time_units
from fxpipe.tracer.measure.unit_runner import UnitRunner
from fxpipe.tracer.train_eval.bothmodes import merge_eval_mode
from fxpipe.tracer.train_eval.mode_probe import (
    graph_takes_mode,
    modes_compute_alike,
)  # Note [one mode is enough]
from fxpipe.tracer.dynamic import ranges_of, resolve_dynamic_dims
from fxpipe.tracer.frontend.export_frontend import infer_dynamic_dims
from fxpipe.tracer.frontend.frontends import trace_graph
from fxpipe.tracer.measure.meta import (
    META,
    SKIPPED_ON_META,
    build_on_meta,
    check_meta_options,
    cost_device_kernels,
    eager_mode,
    is_meta_model,
    move_to_meta,
)
from fxpipe.tracer.train_eval.modes import guarded_regions, is_random_op_name, modes_restored
from fxpipe.tracer.frontend.mutation import isolate_mutations
from fxpipe.tracer.frontend.normalize import (
    annotate_paths,
    drop_extra_placeholders,
    flatten_output,
    group_getitems,
    run_collect,
)
from fxpipe.tracer.construct.pins import module_pins, pin_for_path
from fxpipe.tracer.profile import ModelInfo, ModelProfile, TensorSpec, Unit, UnitEdge
from fxpipe.tracer.construct.meta_buffers import recompute_meta_buffers
from fxpipe.tracer.construct.record import BuildRecord, build_model_recorded
from fxpipe.tracer.measure.shapes import (
    BatchDims,
    batch_size_of,
    describe_tensor,
    infer_batch_dims,
    propagate,
    resolve_batch_dims,
)
from fxpipe.tracer.frontend.leaves import leaf_regions, resolve_leaves
from fxpipe.tracer.frontend.symbolic import LeafSpec, is_torch_nn_leaf
from fxpipe.tracer.traced import TracedModel
from fxpipe.graphmeta import BUFFER_VALUES_KEY, DIM_RANGES_KEY, MUTATIONS_KEY, PATH_KEY, SPEC_KEY
from fxpipe.tracer.units import UnitGroup, group_units, join_units

__all__ = ["trace_model", "trace_model_file"]

_SYMINT_SPEC = TensorSpec(shape=(), dtype="symint", batch_dim=None, requires_grad=False)


@contextlib.contextmanager
def _preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore the model's buffers and the RNG state after the block."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with seeded(None):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in saved:
                    buffer.copy_(value)


def _bind_inputs(
    model: nn.Module, example_inputs: Any, batch_dims: Sequence[int | None] | None
) -> tuple[BoundCall, BatchDims]:
    """The example call bound to ``model.forward`` (Note [the traced call] in ``fxpipe.tracer.call``)
    and the batch dimension of each tensor input."""
    try:
        call = bind_example(model, parse_model_inputs(example_inputs))
    except ValueError as exc:
        raise TraceError(f"example inputs of {type(model).__name__}: {exc}") from None
    try:
        return call, resolve_batch_dims(call.tensors, batch_dims)
    except ValueError as exc:
        raise TraceError(f"{exc} (example inputs: {call.example.describe()})") from None


def _describe_inputs(inputs: Sequence[torch.Tensor]) -> str:
    return ", ".join(describe_tensor(t) for t in inputs)


def _run_eagerly(model: nn.Module, call: ModelInputs) -> Any:
    """The model's own output on the example inputs; a model that fails on them is reported as
    the user's error (out-of-memory is not: it says nothing about the model file)."""
    try:
        with torch.no_grad():
            return call(model)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here comes from the model or its inputs
        message = " ".join(str(exc).split())
        raise ModelFileError(
            f"{type(model).__name__} raised on its example inputs ({call.describe()}): "
            f"{type(exc).__name__}: {message}; check that the example inputs are what forward() expects "
            "(count, shapes, dtypes) and that forward() runs on them in plain PyTorch"
        ) from exc


def _check_output(model: nn.Module, output: Any) -> Any:
    """The model's output, if every leaf of it is a tensor or a plain constant (what a stage can return);
    else a TraceError naming the first other object, where it sits, and (a KV cache) how to leave it out."""
    for path, leaf in pytree.tree_flatten_with_path(output)[0]:
        if leaf is None or isinstance(leaf, (torch.Tensor, bool, int, float, complex, str)):
            continue
        name = type(leaf).__name__
        where = f"output{pytree.keystr(path)}"
        if any(
            c.__name__ == "Cache" for c in type(leaf).__mro__
        ):  # a transformers KV cache (use_cache=True)
            fix = (
                "it is the key/value cache of generation, which training does not use: build the model with "
                "config.use_cache=False, or pass use_cache=False in example_inputs"
            )
        else:
            fix = "return tensors (or plain constants) only, e.g. from a wrapper module's forward"
        raise TraceError(
            f"{type(model).__name__} returns a {name} at {where}: a pipeline stage can pass only "
            f"tensors and plain constants; {fix}"
        )
    return output


def _spec_of_output(node: torch.fx.Node) -> TensorSpec:
    spec = node.meta.get(SPEC_KEY)
    if isinstance(spec, TensorSpec):
        return spec
    if spec is None:
        return _SYMINT_SPEC
    raise TraceError(
        f"node {node.name} passes a {type(spec).__name__} between units; expected a tensor or an int"
    )


def _param_table(
    model: nn.Module,
) -> tuple[dict[str, int], dict[str, tuple[int, ...]], tuple[tuple[str, ...], ...]]:
    """``param_sizes`` and ``param_shapes`` (under the first name of each tensor) and the
    groups of tied names."""
    names: dict[int, list[str]] = {}
    sizes: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in names:
            names[id(p)] = []
            sizes[name] = p.numel() * p.element_size()
            shapes[name] = tuple(p.shape)
        names[id(p)].append(name)
    ties = tuple(tuple(group) for group in names.values() if len(group) > 1)
    return sizes, shapes, ties


def _unit_param_names(
    gm: torch.fx.GraphModule, group: UnitGroup, param_names: set[str]
) -> tuple[str, ...]:
    """Names under which the unit reads parameters (a tied tensor may appear under several)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    names = [
        str(by_name[a].target) for a in group.get_attrs if str(by_name[a].target) in param_names
    ]
    for node in (by_name[n] for n in group.nodes):
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            names += [
                n
                for n, _ in module.named_parameters(prefix=str(node.target), remove_duplicate=False)
            ]
    return tuple(dict.fromkeys(names))


def _module_order(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    order: dict[str, None] = {}
    for node in gm.graph.nodes:
        path = node.meta.get(PATH_KEY, "")
        if node.op in ("placeholder", "get_attr", "output") or not path:
            continue
        parts = path.split(".")
        for depth in range(1, len(parts) + 1):
            order.setdefault(".".join(parts[:depth]))
    return tuple(order)


def _module_type(model: nn.Module, path: str) -> str | None:
    try:
        return type(model.get_submodule(path)).__name__
    except AttributeError:
        return None


def _build_profile(
    model: nn.Module,
    gm: torch.fx.GraphModule,
    groups: list[UnitGroup],
    runners: list[UnitRunner],
    times: list[tuple[float, float]],
    counts: list[UnitCounts],
    activations: list[int],
    pins: dict[str, int],
    batch: int,
    frontend: str,
    timing: str,
    trace_device: str,
    on_meta: bool = False,
    host_call_ms: float | None = None,
    compiled: bool = False,
    compile_factor: float | None = None,
) -> ModelProfile:
    by_name = {n.name: n for n in gm.graph.nodes}
    sizes, shapes, ties = _param_table(model)
    param_names = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    charged: set[int] = set()
    group_of = {node: g for g in groups for node in g.nodes}
    units: dict[str, Unit] = {}
    edges = []
    for group, runner, (fwd_ms, bwd_ms), c, act in zip(groups, runners, times, counts, activations):
        param_bytes = buffer_bytes = 0
        for t in runner.tensors:
            if id(t) in charged:
                continue
            charged.add(id(t))
            if isinstance(t, nn.Parameter):
                param_bytes += t.numel() * t.element_size()
            else:
                buffer_bytes += t.numel() * t.element_size()
        units[group.name] = Unit(
            name=group.name,
            module_path=group.path,
            kind=group.kind,
            module_type=_module_type(model, group.path),
            outputs=tuple(_spec_of_output(by_name[o]) for o in group.outputs),
            fwd_ms=fwd_ms,
            bwd_ms=bwd_ms,
            fwd_flops=c.fwd_flops,
            param_bytes=param_bytes,
            buffer_bytes=buffer_bytes,
            activation_bytes=act,
            params=_unit_param_names(gm, group, param_names),
            reads_inputs=group.reads_inputs,
            pin=pin_for_path(pins, group.path),
            random=any(is_random_op_name(op) for op, _ in c.fwd_ops),
            weight_grad_fraction=c.weight_grad_fraction,
            saved_tensors=c.saved_tensors,
        )
        sources: dict[str, list[int]] = {}
        for name in group.inputs:
            if by_name[name].op == "placeholder":
                continue
            src_group = group_of[name]
            sources.setdefault(src_group.name, []).append(src_group.outputs.index(name))
        for src_name, outs in sources.items():
            src = units[src_name]
            outs = sorted(set(outs))
            edges.append(
                UnitEdge(
                    src=src_name,
                    dst=group.name,
                    bytes=sum(src.outputs[i].nbytes for i in outs),
                    outputs=tuple(outs),
                )
            )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return ModelProfile(
        units=tuple(units.values()),
        edges=tuple(edges),
        batch_size=batch,
        inputs=tuple(n.meta[SPEC_KEY] for n in placeholders),
        trace_device=trace_device,
        frontend=frontend,
        timing=timing,
        module_order=_module_order(gm),
        param_sizes=sizes,
        param_shapes=shapes,
        ties=ties,
        model=ModelInfo(class_name=f"{type(model).__module__}.{type(model).__qualname__}"),
        meta=on_meta,
        skipped_checks=SKIPPED_ON_META if on_meta else (),
        host_call_ms=host_call_ms,
        compiled=compiled,
        compile_factor=compile_factor,
    )


def trace_model(
    model: nn.Module,
    example_inputs: Any,
    *,
    frontend: str = "auto",
    leaves: Sequence[LeafSpec] = (),
    measure_times: bool = False,
    measure_memory: bool = False,
    trace_device: str = "cpu",
    build_record: BuildRecord | None = None,
    progress: bool = True,
    batch_dims: Sequence[int | None] | None = None,
    cost_device: str | None = None,
    dynamic_dims: Mapping[str, Mapping[int, Any]] | None = None,
    compile: bool = False,
    compile_factor: float | None = None,
) -> TracedModel:
    """Trace ``model`` on ``example_inputs`` and profile its units.

    ``example_inputs``: the model's positional arguments (a tuple, or one tensor), its
    keyword arguments (a dict), an ``(args, kwargs)`` pair, or a ``ModelInputs``. Tensors
    become the graph's inputs, named after the forward's parameters; every other
    argument, and every parameter left at its default, is a constant of the trace (Note
    [the traced call] in :mod:`fxpipe.tracer.call`; ``TracedModel.call`` records them).
    ``batch_dims``: each tensor input's batch dimension (in the forward's parameter
    order), ``None`` for an input shared by all
    samples (a ``[T, T]`` mask); by default dim 0 of every non-scalar input, which is
    wrong for sequence-first inputs (see the Note in :mod:`fxpipe.tracer.measure.shapes`;
    :func:`trace_model_file` takes them from the model file instead).
    The model first runs once on the inputs: if it raises, a :class:`ModelFileError`
    names the inputs and the failing call.
    ``frontend``: ``"auto"`` | ``"symbolic"`` | ``"export"``. ``leaves``: module classes,
    class names or paths to keep whole, on both front ends (:mod:`fxpipe.tracer.frontend.leaves`).
    ``measure_times``: time each unit on ``trace_device`` instead of the analytic roofline estimate. ``measure_memory``: activation bytes from the CUDA
    allocator instead of autograd's saved tensors. ``build_record``: from
    :func:`build_model_recorded`, for pins and leaf constructor arguments.
    ``trace_device="meta"`` (taken by itself for a model built on the meta device) traces
    with meta tensors and prices units with ``cost_device``'s analytic estimate (default
    ``"cpu"``); checks that need values are skipped and listed in ``profile.skipped_checks``,
    and the model stays on meta (Note [meta tracing] in :mod:`fxpipe.tracer.measure.meta`).
    ``dynamic_dims``: the input dimensions besides the batch that follow the data, by input name
    (``{"input_ids": {1: "seq"}}``; Note [dynamic dimensions] in :mod:`fxpipe.tracer.dynamic`);
    every tensor's shape formula is in its ``TensorSpec.dims`` and the ranges in ``profile.dynamic``.
    ``compile``: price the units as compiled stages run them (``fxpipe run --compile``): measured,
    each unit under ``torch.compile`` (Note [compiled unit times] in :mod:`fxpipe.tracer.measure.timing`);
    analytic, the estimate times ``compile_factor`` (default the cost device's preset's,
    ``calibration.json``). ``profile.compiled`` records it.

    Example::

        traced = trace_model(GPT(), (torch.randint(0, 64, (4, 16)),))
        traced.profile.units[0].name, traced.graph_module(idx)
        trace_model(hf_gpt2, {"input_ids": ids, "attention_mask": mask, "labels": ids})
    """
    call, dims = _bind_inputs(model, example_inputs, batch_dims)
    dynamic = resolve_dynamic_dims(call.spec.inputs, call.tensors, dims, dynamic_dims)
    leaf_paths = resolve_leaves(
        model, leaves
    )  # a name that matches nothing is refused, not ignored
    if trace_device != META and is_meta_model(
        model
    ):  # Note [meta tracing]: the factory built it on meta
        trace_device, cost_device = META, cost_device or trace_device
    on_meta = trace_device == META
    if on_meta:
        check_meta_options(model, measure_times, measure_memory)
        cost_device = cost_device or "cpu"
    elif trace_device not in DEVICE_PRESETS:
        raise TraceError(
            f"trace_device {trace_device!r} is not one of {sorted([*DEVICE_PRESETS, META])}"
        )
    cost_device = cost_device or trace_device
    if cost_device not in DEVICE_PRESETS:
        raise TraceError(f"cost_device {cost_device!r} is not one of {sorted(DEVICE_PRESETS)}")
    if compile_factor is not None and not compile:
        raise TraceError("compile_factor prices compiled stages: give it with compile (--compile)")
    if compile_factor is not None and measure_times:
        raise TraceError(
            "compile_factor scales analytic times; with measure_times the units are timed "
            "compiled: leave one of them out"
        )
    if compile_factor is not None and not compile_factor > 0:
        raise TraceError(f"compile_factor must be > 0, got {compile_factor}")
    if compile and measure_times:
        factor = None  # the units are timed compiled (Note [compiled unit times])
    elif compile:
        factor = compile_factor or DEVICE_PRESETS[cost_device].compile_factor
    else:
        factor = None
    if trace_device == "cuda" and not torch.cuda.is_available():
        raise TraceError(
            "trace_device 'cuda' was asked for but CUDA is not available; use trace_device='cpu'"
        )
    if measure_memory and trace_device != "cuda":
        raise TraceError(
            "measure_memory needs the CUDA allocator; use trace_device='cuda' or leave it off "
            "(activation bytes then come from autograd's saved tensors)"
        )
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())} or {
        torch.device("cpu")
    }
    original_device = next(iter(devices))
    buffer_values: dict[str, torch.Tensor] = {}
    recomputed: tuple[str, ...] = ()
    if on_meta:  # Note [computed buffers on meta]: a model built on meta has meta buffers too
        buffer_values, recomputed = recompute_meta_buffers(
            model, build_record.ctor_args if build_record else None
        )
        buffer_values.update(move_to_meta(model))
    else:
        model.to(trace_device)
    call = call.with_tensors([t.to(trace_device) for t in call.tensors])
    inputs = call.tensors
    batch = batch_size_of(inputs, dims)
    try:
        with _preserved_state(model), modes_restored(model):
            model.train()  # the profile is of train mode; eval mode is merged in (Note [both modes in one graph])
            with phase("trace") as tracing:
                ctor_args = build_record.ctor_args if build_record else None
                with _seeded(trace_device), eager_mode(on_meta):
                    reference, output_spec = pytree.tree_flatten(
                        _check_output(model, _run_eagerly(model, call.example))
                    )
                with tracing_call(call):
                    result = trace_graph(
                        model, inputs, frontend, leaf_paths, dims, ctor_args, dynamic
                    )
                gm = result.graph_module
                if on_meta:  # Note [parameters on meta, buffers real]: codegen writes them
                    gm.meta[BUFFER_VALUES_KEY] = buffer_values
                values = _normalize(gm, inputs, trace_device)
                if not on_meta:  # meta tensors hold no values to compare (SKIPPED_ON_META)
                    _check_matches(gm, values, reference)

                def trace_again() -> (
                    torch.fx.GraphModule
                ):  # as the train graph was traced, fallback leaves included
                    with tracing_call(call):
                        again = trace_graph(
                            model,
                            inputs,
                            result.frontend,
                            (*leaf_paths, *result.fallback_leaves),
                            tuple(None for _ in dims) if result.static_batch else dims,
                            ctor_args,
                            dynamic,
                        )
                    _normalize(again.graph_module, inputs, trace_device)
                    return again.graph_module

                run = lambda: _run_in(eager_mode(on_meta), call.example, model)  # noqa: E731
                one_mode = not graph_takes_mode(gm) and modes_compute_alike(model, inputs, run)
                if not one_mode:
                    merge_eval_mode(
                        model, gm, inputs, trace=trace_again, check=not on_meta, run=run
                    )
                with cost_device_kernels(on_meta, cost_device):  # Note [attention kernels on meta]
                    ranges = ranges_of(inputs, dynamic, gm.meta.get(DIM_RANGES_KEY, {}))
                    prop = propagate(
                        gm, inputs, batch, dims, dynamic, ranges, static=bool(result.static_batch)
                    )
                regions, gm.meta[MUTATIONS_KEY] = isolate_mutations(gm, prop.values, prop.mutations)
                regions += [{n.name for n in region} for region in guarded_regions(gm.graph)]
                regions += leaf_regions(
                    gm, leaf_paths
                )  # export traces into leaves: keep each in one unit
                groups = join_units(
                    gm, group_units(gm, prop.flops), regions
                )  # a mode-guarded region stays whole
                runners = [UnitRunner(gm, g, prop.values) for g in groups]
                modes = "train = eval mode" if one_mode else "train and eval mode"
                tracing.detail = f"{result.frontend}, {modes}, {len(groups)} units"
            with phase("count") as counted, cost_device_kernels(on_meta, cost_device):
                counting = lambda rs: progress_iter(rs, "counting units", progress, len(rs))  # noqa: E731
                counts = count_units_once(runners, count_unit, counting)
                counted.detail = f"{len(runners)} units"
            scalings = None
            if ranges:  # Note [costs at other sizes]
                with (
                    phase("count at other lengths") as scaled,
                    cost_device_kernels(on_meta, cost_device),
                ):
                    try:
                        scalings = unit_scalings(
                            gm, groups, inputs, dynamic, ranges, counts, DEVICE_PRESETS[cost_device]
                        )
                        scaled.detail = ", ".join(r.name for r in ranges)
                    except Exception as exc:  # noqa: BLE001 - the profile is whole without it
                        warnings.warn(
                            f"fxpipe: counting the units at other lengths failed ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}); the profile prices its traced "
                            "length only (--seq-len needs a trace that counts them)",
                            stacklevel=2,
                        )
            host_call_ms = None
            if measure_times:
                with phase("time units") as timing:
                    times, host_call_ms = time_units(  # Notes [unit call cost], [host speed]
                        runners,
                        trace_device,
                        lambda rs: progress_iter(rs, "timing units", progress, len(rs)),
                        compiled=compile,
                    )
                    timing.detail = f"{len(runners)} units on {trace_device}" + (
                        ", compiled" if compile else ""
                    )
            else:
                times = [analytic_ms(c, DEVICE_PRESETS[cost_device]) for c in counts]
                if factor is not None:  # the compiled-kernel factor (calibration.json)
                    times = [(f * factor, b * factor) for f, b in times]
            activations = (
                [measure_memory_bytes(r) for r in runners]
                if measure_memory
                else [c.activation_bytes for c in counts]
            )
    finally:
        if not on_meta:
            model.to(original_device)
    pins = {**module_pins(model), **(build_record.pins if build_record else {})}
    profile = _build_profile(
        model,
        gm,
        groups,
        runners,
        times,
        counts,
        activations,
        pins,
        batch,
        result.frontend,
        "measured" if measure_times else "analytic",
        cost_device,
        on_meta,
        host_call_ms,
        compile,
        factor,
    )
    if recomputed:
        profile = dataclasses.replace(profile, recomputed_buffers=recomputed)
    profile = dataclasses.replace(profile, dynamic=ranges)
    if scalings is not None:
        units = tuple(dataclasses.replace(u, scaling=sc) for u, sc in zip(profile.units, scalings))
        profile = dataclasses.replace(profile, units=units)
    leaf_modules = {
        str(n.target): type(gm.get_submodule(str(n.target)))
        for n in gm.graph.nodes
        if n.op == "call_module"
    }
    ctor_args = build_record.ctor_args if build_record else {}
    user_leaf_args = {
        path: ctor_args[path]
        for path in leaf_modules
        if not is_torch_nn_leaf(model.get_submodule(path)) and path in ctor_args
    }
    return TracedModel(
        model=model,
        graph_module=gm,
        profile=profile,
        unit_of_node={node: g.name for g in groups for node in g.nodes},
        frontend=result.frontend,
        output_spec=output_spec,
        leaf_modules=leaf_modules,
        user_leaf_args=user_leaf_args,
        call=call.spec,
        example_inputs=inputs if on_meta else tuple(t.to(original_device) for t in inputs),
        static_batch=result.static_batch,
    )


def _run_in(
    context: contextlib.AbstractContextManager[Any], call: ModelInputs, model: nn.Module
) -> Any:
    with context:
        return call(model)


@contextlib.contextmanager
def _seeded(device: str, seed: int = 0) -> Iterator[None]:
    """Run the block from a fixed RNG state and restore the state afterwards: the model's own run and the
    traced graph's run draw the same dropout masks, so :func:`_check_matches` compares like with like."""
    cuda = [torch.cuda.current_device()] if device == "cuda" else []
    with seeded(seed, cuda):  # Note [one random state for both sides]
        yield


def _normalize(
    gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], device: str
) -> dict[torch.fx.Node, Any]:
    """Bring a front end's graph into the normalized form (Note [normalized graph]); its values on ``inputs``
    (from the seed of :func:`_seeded`)."""
    annotate_paths(gm)
    drop_extra_placeholders(gm, len(inputs))
    with torch.no_grad(), _seeded(device):
        values = run_collect(gm, inputs)
    flatten_output(gm, values)  # export graphs are flat already: the model's own spec rebuilds them
    group_getitems(gm)
    return values


def _check_matches(
    gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], reference: list[Any]
) -> None:
    """Warn when the traced graph's outputs differ from the model's own (both run from the same seed,
    :func:`_seeded`, so random ops agree; a difference means the trace lost something)."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    got = [values[n] for n in out_node.args[0]]
    if len(got) != len(reference):
        raise TraceError(
            f"the traced graph returns {len(got)} tensors but the model returns {len(reference)}; "
            "return only tensors (in tuples, dicts or ModelOutputs) from forward"
        )
    if not all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True) for a, b in zip(got, reference)
    ):
        warnings.warn(
            "fxpipe: the traced graph's outputs differ from the model's own (both run from the same "
            "seed); the model may depend on state the trace did not capture, or draw random numbers "
            "in another order",
            stacklevel=3,
        )


def trace_model_file(source: ModelSource, batch_size: int, **options: Any) -> TracedModel:
    """Build the model of a model file (recording pins and constructor args) and trace it at ``batch_size``.

    The inputs' batch dimensions come from the model file: the dimension that doubles
    from ``example_inputs(batch_size)`` to ``example_inputs(2 * batch_size)`` (none for an
    input whose shape stays, such as a shared mask). ``dynamic``: ``"model"`` (the default) takes
    the other dynamic dimensions from the model file's ``dynamic_dims()``, if it has one;
    ``"auto"`` infers them (Note [dynamic dimensions] in :mod:`fxpipe.tracer.dynamic`); ``"none"``
    keeps only the batch dynamic.
    """
    factory = source.build_model
    if options.get("trace_device") == META:  # Note [meta tracing]
        factory = lambda: build_on_meta(source.build_model)  # noqa: E731
    with phase("build the model"):
        model, record = build_model_recorded(factory)
    inputs = source.example_call(batch_size)
    if options.get("batch_dims") is None:
        options["batch_dims"] = _model_file_batch_dims(source, model, batch_size, inputs)
    how = options.pop("dynamic", "model")
    if options.get("dynamic_dims") is None and how != "none":
        options["dynamic_dims"] = (
            infer_dynamic_dims(model, inputs, options["batch_dims"])
            if how == "auto"
            else source.dynamic_dims()
        )
    try:
        traced = trace_model(model, inputs, build_record=record, **options)
    except ModelFileError as exc:  # the model rejected its inputs: say which file and functions
        raise ModelFileError(
            f"in {source.path.name} ({source.model_fn}() on {source.inputs_fn}({batch_size})): "
            f"{exc}"
        ) from exc
    model_info = dataclasses.replace(
        traced.profile.model, file=str(source.path), sha256=source.sha256, factory=source.model_fn
    )
    traced.profile = dataclasses.replace(traced.profile, model=model_info)
    return traced


def _model_file_batch_dims(
    source: ModelSource, model: nn.Module, batch_size: int, inputs: ModelInputs
) -> BatchDims:
    """Compare ``example_inputs(B)`` with ``example_inputs(2B)``: the dimension that doubles is the batch
    (of each tensor input, in the forward's parameter order)."""
    fn = f"{source.path.name}:{source.inputs_fn}"
    try:
        first, second = (
            bind_example(model, inputs),
            bind_example(model, source.example_call(2 * batch_size)),
        )
    except ValueError as exc:
        raise ModelFileError(f"{fn}({batch_size}) for {type(model).__name__}: {exc}") from None
    if first.spec != second.spec:
        raise ModelFileError(
            f"{fn}({batch_size}) and {fn}({2 * batch_size}) pass different arguments "
            f"({inputs.describe()} vs {second.example.describe()}); only the batch may change"
        )
    try:
        dims = infer_batch_dims(first.tensors, second.tensors)
    except ValueError as exc:
        raise ModelFileError(
            f"{fn}({batch_size}) and {fn}({2 * batch_size}) disagree: {exc}; make the batch "
            "size scale one dimension of each batched input"
        ) from None
    if all(d is None for d in dims):
        raise ModelFileError(
            f"{fn}({batch_size}) and {fn}({2 * batch_size}) return the same shapes "
            f"({_describe_inputs(first.tensors)}); build the inputs with batch_size samples"
        )
    return dims
