"""Shape propagation: every node's ``TensorSpec``, its batch dimension and forward FLOPs.

The graph runs twice: at the traced batch ``B`` (with autograd on and floating inputs
requiring grad, so ``requires_grad`` is exactly "depends on a parameter or a floating
input"; with ``FlopCounterMode`` to charge FLOPs to each node) and at ``2B`` (each input
concatenated with itself along its batch dimension). A dimension whose size doubles is
the batch dimension. The first run also notes the in-place calls (Note [in-place ops
across stages] in :mod:`fxpipe.tracer.frontend.mutation`).

Note (batch dimensions of the inputs): the graph cannot tell which dimension of an
input is the batch, so the caller says it with ``batch_dims`` (one entry per input,
``None`` for an input shared by all samples, such as a ``[T, T]`` mask). A model file
knows its layout: :func:`fxpipe.tracer.trace_model_file` compares
``example_inputs(B)`` with ``example_inputs(2B)`` (:func:`infer_batch_dims`). Without a
model file or explicit ``batch_dims``, dim 0 of every non-scalar input is assumed
(:func:`default_batch_dims`), which is wrong for sequence-first inputs and shared
non-batched inputs.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.tracer.train_eval.modes import guard_of, is_training_flag, run_in_mode
from fxpipe.errors import TraceError
from fxpipe.shapeformula import BATCH, UNKNOWN, DimRange, fit_dim
from fxpipe.tracer.measure.data_shapes import data_dependent_dims
from fxpipe.tracer.dynamic import DynamicDims, probe_inputs, probe_size
from fxpipe.tracer.frontend.mutation import MutationLog
from fxpipe.tracer.profile import TensorSpec
from fxpipe.graphmeta import SPEC_KEY

__all__ = [
    "BatchDims",
    "Propagation",
    "propagate",
    "double_batch",
    "default_batch_dims",
    "infer_batch_dims",
    "resolve_batch_dims",
    "describe_tensor",
    "batch_size_of",
    "dtype_name",
    "requiring_grad",
    "train_values",
]

BatchDims = tuple[int | None, ...]


@dataclass(frozen=True)
class Propagation:
    """Values of one run at the traced batch, keyed by node, forward FLOPs per node name, and the
    in-place calls of that run (node name -> names of the arguments it changed)."""

    values: dict[torch.fx.Node, Any]
    flops: dict[str, float]
    mutations: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_batch_dims(inputs: Sequence[torch.Tensor]) -> BatchDims:
    """The guess without a model file: dim 0 of every non-scalar input (see the module Note)."""
    return tuple(0 if t.dim() > 0 else None for t in inputs)


def resolve_batch_dims(
    inputs: Sequence[torch.Tensor], batch_dims: Sequence[int | None] | None
) -> BatchDims:
    """Check ``batch_dims`` against the inputs (negative dims count from the end), or default them.

    Raises ``ValueError`` (the caller turns it into its own error) when the length or a
    dimension does not fit, or when no input has a batch dimension.
    """
    if batch_dims is None:
        dims: BatchDims = default_batch_dims(inputs)
    else:
        if len(batch_dims) != len(inputs):
            raise ValueError(
                f"batch_dims has {len(batch_dims)} entries but there are {len(inputs)} inputs; "
                "give one entry per input (None for an input without a batch dimension)"
            )
        resolved = []
        for i, (t, d) in enumerate(zip(inputs, batch_dims)):
            if d is not None and not -t.dim() <= d < t.dim():
                raise ValueError(
                    f"batch_dims[{i}] is {d} but input {i} has shape {list(t.shape)}; "
                    f"use a dimension in {-t.dim()}..{t.dim() - 1} or None"
                )
            resolved.append(None if d is None else d % t.dim())
        dims = tuple(resolved)
    if all(d is None for d in dims):
        raise ValueError(
            "no input has a batch dimension; fxpipe splits microbatches along it, so at least "
            "one input needs one"
        )
    return dims


def infer_batch_dims(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> BatchDims:
    """Batch dimensions from the inputs at batch ``B`` (``first``) and ``2B`` (``second``).

    An input whose shape is unchanged has no batch dimension; otherwise exactly one
    dimension must have doubled. Raises ``ValueError`` naming the input that breaks this.
    """
    if len(first) != len(second):
        raise ValueError(
            f"{len(first)} inputs at the traced batch but {len(second)} at twice that batch"
        )
    dims: list[int | None] = []
    for i, (a, b) in enumerate(zip(first, second)):
        if a.dim() != b.dim() or a.dtype != b.dtype:
            raise ValueError(
                f"input {i} is {describe_tensor(a)} at the traced batch but {describe_tensor(b)} at twice that "
                "batch; only the size of the batch dimension may change"
            )
        changed = [d for d, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(changed) > 1 or (changed and b.shape[changed[0]] != 2 * a.shape[changed[0]]):
            raise ValueError(
                f"input {i} is {describe_tensor(a)} at the traced batch but {describe_tensor(b)} at twice that "
                "batch; exactly one dimension (the batch) may change, and it must double"
            )
        dims.append(changed[0] if changed else None)
    return tuple(dims)


def batch_size_of(inputs: Sequence[torch.Tensor], batch_dims: Sequence[int | None]) -> int:
    """The batch size: the batch dimension's size on the first batched input."""
    return next(int(t.shape[d]) for t, d in zip(inputs, batch_dims) if d is not None)


def double_batch(
    inputs: tuple[torch.Tensor, ...], batch_dims: Sequence[int | None] | None = None
) -> tuple[torch.Tensor, ...]:
    """The same samples twice: each batched input concatenated with itself along its batch dimension.

    Inputs without a batch dimension (``None``) are passed as they are; ``batch_dims``
    defaults to :func:`default_batch_dims`.
    """
    dims = default_batch_dims(inputs) if batch_dims is None else batch_dims
    return tuple(t if d is None else torch.cat([t, t], dim=d) for t, d in zip(inputs, dims))


def describe_tensor(t: torch.Tensor) -> str:
    """``float32[2, 5]``: a tensor's dtype and shape, for messages."""
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def requiring_grad(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Detached copies of the inputs; floating ones require grad."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)


class _Counting(torch.fx.Interpreter):
    """Runs the merged graph in train mode (the profile's), eval-only nodes skipped (Note
    [eval-only nodes in shape propagation])."""

    def __init__(self, gm: torch.fx.GraphModule, counter: FlopCounterMode | None) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.counter = counter
        self.flops: dict[str, float] = {}
        self.mutations = MutationLog()
        self.unrun: list[torch.fx.Node] = []  # eval-only nodes that fail on train mode's values
        self.current: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n
        if is_training_flag(n):
            return True
        if guard_of(n) is False:
            try:
                return self._run(n)
            except Exception:  # noqa: BLE001 - needs eval mode's values: Note [eval-only nodes ...]
                self.flops[n.name] = 0.0
                self.unrun.append(n)
                return None
        return self._run(n)

    def _run(self, n: torch.fx.Node) -> Any:
        if self.counter is None:
            return super().run_node(n)
        before = self.counter.get_total_flops()
        result = self.mutations.run(n, self.env, lambda: super(_Counting, self).run_node(n))
        self.flops[n.name] = float(self.counter.get_total_flops() - before)
        return result


def _spec(value: Any, doubled: Any, batch: int) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorSpec(
            shape=tuple(value.shape),
            dtype=dtype_name(value.dtype),
            batch_dim=_batch_dim(value, doubled, batch),
            requires_grad=value.requires_grad,
        )
    if isinstance(value, (tuple, list)):
        others = (
            doubled
            if isinstance(doubled, (tuple, list)) and len(doubled) == len(value)
            else [None] * len(value)
        )
        return tuple(_spec(v, d, batch) for v, d in zip(value, others))
    return None


def _batch_dim(value: torch.Tensor, doubled: Any, batch: int) -> int | None:
    if isinstance(doubled, torch.Tensor) and doubled.dim() == value.dim():
        for dim, (a, b) in enumerate(zip(value.shape, doubled.shape)):
            if b == 2 * a and a > 0:
                return dim
        return None
    # no second run: assume a leading dimension equal to the batch is the batch
    return 0 if value.dim() > 0 and value.shape[0] == batch else None


# Note [eval-only nodes in shape propagation]: a merged graph (Note [both modes in one graph] in
# fxpipe.tracer.train_eval.modes) may hold nodes that run in eval mode only, reading a
# ``train_or_eval(training, a, b)`` whose two values differ in shape: transformers' Mamba calls
# ``self.D.float()`` and ``self.dt_proj.bias.float()`` for its fused kernel in train mode only, and
# the merge pairs those casts with other train nodes. Run in train mode, such a node gets the
# train value and fails ("The size of tensor a (16) must match the size of tensor b (8)"). The
# counting run still runs eval-only nodes on train mode's values where they can (their in-place
# calls are seen, Note [in-place ops across stages]); one that fails is skipped (no FLOPs: the
# emitted code does not run it in train mode, whose profile this is) and its shape comes from
# one run of the graph in eval mode. ``UnitRunner`` leaves eval-only nodes out of the units it
# counts and times, as the emitted code does in train mode.


class _Static(Exception):
    """A static graph is not run at ``2B``."""


def propagate(
    gm: torch.fx.GraphModule,
    inputs: tuple[torch.Tensor, ...],
    batch_size: int,
    batch_dims: Sequence[int | None] | None = None,
    dynamic: DynamicDims | None = None,
    ranges: Sequence[DimRange] = (),
    *,
    static: bool = False,
) -> Propagation:
    """Run ``gm`` at ``B`` and ``2B`` and set ``node.meta[SPEC_KEY]`` on every node.

    ``batch_dims`` says along which dimension each input grows for the ``2B`` run
    (default: :func:`default_batch_dims`; see the module Note). A ``static`` graph (Note [a batch
    the model fixes]) runs at ``B`` only: dimension 0 is the batch wherever its size equals ``B``.
    ``dynamic`` / ``ranges``: the other dynamic dimensions (Note [dynamic dimensions] in
    :mod:`fxpipe.tracer.dynamic`); the graph also runs with each of them at a probe size, and with
    all sizes changed at once, to fit every tensor's shape formula (``TensorSpec.dims``, Note [shape
    formulas]). A run at a probe size that fails means the graph specialised that dimension: a
    ``TraceError`` names the node.
    """
    counting = _Counting(gm, FlopCounterMode(display=False))
    with counting.counter:  # type: ignore[union-attr]
        counting.run(*requiring_grad(inputs))
    if counting.unrun:  # Note [eval-only nodes in shape propagation]
        in_eval = run_in_mode(gm, requiring_grad(inputs), training=False)
        counting.env.update((n, in_eval[n]) for n in counting.unrun)
    doubled: dict[torch.fx.Node, Any] = {}
    try:
        if static:
            raise _Static
        with torch.no_grad():
            second = _Counting(gm, None)
            second.run(*double_batch(inputs, batch_dims))
            doubled = second.env
            if second.unrun:
                in_eval = run_in_mode(gm, double_batch(inputs, batch_dims), training=False)
                doubled.update((n, in_eval[n]) for n in second.unrun)
    except _Static:
        pass
    except Exception as exc:  # noqa: BLE001 - we can still guess, but say so
        warnings.warn(
            f"fxpipe: running the graph at batch {2 * batch_size} failed ({type(exc).__name__}: {exc}); "
            "assuming dimension 0 is the batch dimension wherever its size equals the batch",
            stacklevel=2,
        )
    dims = default_batch_dims(inputs) if batch_dims is None else tuple(batch_dims)
    dynamic = dynamic or tuple({} for _ in inputs)
    probes = {r.name: (r.traced, probe_size(r)) for r in ranges}
    runs = {BATCH: doubled} if doubled else {}
    for r in ranges:
        runs[r.name] = _probe_run(
            gm,
            probe_inputs(inputs, dynamic, {r.name: probes[r.name][1]}),
            r.name,
            probes[r.name][1],
        )
    together: dict[torch.fx.Node, Any] = doubled
    if ranges and doubled:
        all_probed = probe_inputs(
            double_batch(inputs, batch_dims), dynamic, {s: p[1] for s, p in probes.items()}
        )
        together = _probe_run(gm, all_probed, ", ".join(probes), None)
    probes[BATCH] = (batch_size, 2 * batch_size)
    # Note [data-dependent shapes]
    data = data_dependent_dims(gm, inputs, lambda g: _Counting(g, None), counting.env)
    placeholders = iter(dims)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        value = counting.env[node]
        spec = _spec(value, doubled.get(node), batch_size)
        if node.op == "placeholder" and isinstance(spec, TensorSpec):
            spec = dataclasses.replace(spec, batch_dim=next(placeholders))  # known, not guessed
        if runs:
            spec = _with_formulas(
                spec,
                value,
                {s: run.get(node) for s, run in runs.items()},
                together.get(node),
                probes,
            )
        if node in data:
            spec = _data_dependent(spec, data[node])
        node.meta[SPEC_KEY] = spec
    return Propagation(
        values=counting.env, flops=counting.flops, mutations=counting.mutations.found
    )


def train_values(
    gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...]
) -> dict[torch.fx.Node, Any]:
    """Every node's value in one train-mode run on ``inputs`` (floating inputs requiring grad), as the
    counting run of :func:`propagate` records them, for units to be counted at other sizes."""
    run = _Counting(gm, None)
    run.run(*requiring_grad(inputs))
    if run.unrun:  # Note [eval-only nodes in shape propagation]
        in_eval = run_in_mode(gm, requiring_grad(inputs), training=False)
        run.env.update((n, in_eval[n]) for n in run.unrun)
    return run.env


def _probe_run(
    gm: torch.fx.GraphModule, inputs: tuple[torch.Tensor, ...], symbols: str, size: int | None
) -> dict[torch.fx.Node, Any]:
    """The values of one run at other sizes; a failure names the node where the graph specialised."""
    runner = _Counting(gm, None)
    try:
        with torch.no_grad():
            runner.run(*inputs)
    except Exception as exc:  # noqa: BLE001 - the message goes to the user
        node = runner.current
        where = f"node {node.name!r}" if node is not None else "the graph"
        frame = (
            node.meta.get("stack_trace", "").strip().splitlines()[-2:-1] if node is not None else []
        )
        at = f" ({frame[0].strip()})" if frame else ""
        sizes = f"{symbols} = {size}" if size is not None else f"{symbols} changed together"
        message = " ".join(str(exc).split())[:200]
        raise TraceError(
            f"the traced graph fails at {sizes}: {where}{at} raised {type(exc).__name__}: {message}; the "
            f"model specialises {symbols} there: declare a range that holds, or leave it static"
        ) from exc
    return runner.env


def _with_formulas(
    spec: Any, value: Any, runs: dict[str, Any], together: Any, probes: dict[str, tuple[int, int]]
) -> Any:
    if isinstance(spec, tuple) and isinstance(value, (tuple, list)):

        def at(v: Any, i: int) -> Any:
            return v[i] if isinstance(v, (tuple, list)) and len(v) == len(value) else None

        return tuple(
            _with_formulas(sp, v, {s: at(r, i) for s, r in runs.items()}, at(together, i), probes)
            for i, (sp, v) in enumerate(zip(spec, value))
        )
    if not isinstance(spec, TensorSpec) or not isinstance(value, torch.Tensor):
        return spec
    traced = {s: p[0] for s, p in probes.items()}
    formulas = []
    for d, size in enumerate(value.shape):
        moved: dict[str, tuple[int, int, int]] = {}
        known = True
        for s, run in runs.items():
            if not isinstance(run, torch.Tensor) or run.dim() != value.dim():
                known = False
                break
            moved[s] = (probes[s][0], probes[s][1], int(run.shape[d]))
        if not known:
            formulas.append(UNKNOWN)
            continue
        both = (
            int(together.shape[d])
            if isinstance(together, torch.Tensor) and together.dim() == value.dim()
            else None
        )
        formulas.append(fit_dim(int(size), moved, traced, both))
    return dataclasses.replace(spec, dims=tuple(formulas))


def _data_dependent(spec: Any, dims: Any) -> Any:
    """``spec`` with the dimensions ``dims`` that depend on the data set to ``"?"`` (Note [data-dependent
    shapes] in :mod:`fxpipe.tracer.measure.data_shapes`), whatever formula the runs at other sizes fitted."""
    if isinstance(spec, tuple) and isinstance(dims, tuple) and len(spec) == len(dims):
        return tuple(_data_dependent(sp, d) for sp, d in zip(spec, dims))
    if not isinstance(spec, TensorSpec) or not isinstance(dims, frozenset):
        return spec
    known = spec.dims or tuple(
        BATCH if d == spec.batch_dim else str(size) for d, size in enumerate(spec.shape)
    )
    return dataclasses.replace(
        spec, dims=tuple(UNKNOWN if d in dims else f for d, f in enumerate(known))
    )
