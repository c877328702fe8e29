"""Counting what a unit does: FLOPs, dispatched aten ops and the bytes it saves for backward.

The unit runs forward under ``FlopCounterMode`` and ``saved_tensors_hooks`` (activation
bytes = storages autograd saves for backward, deduplicated, parameters and buffers
excluded), then backward under ``FlopCounterMode``; a second pass counts the aten ops
(Note [analytic unit time] in :mod:`fxpipe.tracer.measure.calibration`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.graphmeta import GUARD_KEY
from fxpipe.tracer.measure.calibration import ACCUMULATE_OP
from fxpipe.tracer.measure.meta import storage_key
from fxpipe.tracer.measure.unit_runner import UnitRunner, fresh_copies, nbytes

__all__ = [
    "UnitCounts",
    "OpCounter",
    "count_unit",
    "count_ops",
    "unit_structure_key",
    "count_units_once",
]


@dataclass(frozen=True)
class UnitCounts:
    """What one forward/backward of a unit does, independent of timing."""

    fwd_flops: float
    bwd_flops: float
    fwd_bytes: int  # inputs + outputs + parameters and buffers read
    activation_bytes: int
    n_ops: int  # FX nodes of the unit
    has_backward: bool
    fwd_ops: tuple[tuple[str, int], ...] = ()  # dispatched aten ops (name, calls); empty: use n_ops
    bwd_ops: tuple[tuple[str, int], ...] = ()
    bwd_input_flops: float | None = (
        None  # of bwd_flops, those of the input gradients (the rest: weights)
    )
    input_grads: bool = True  # some input of the unit needs a gradient
    saved_tensors: int | None = (
        None  # tensors autograd saves per forward, repeats and parameters included
    )

    @property
    def weight_grad_fraction(self) -> float | None:
        """Share of the backward FLOPs that compute weight gradients (what a split ``W`` runs);
        all of it when no input needs a gradient (an embedding of token ids)."""
        if not self.input_grads and self.has_backward:
            return 1.0
        if self.bwd_input_flops is None or self.bwd_flops <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.bwd_input_flops / self.bwd_flops))


# ``torch.tensor(...)`` inside a forward dispatches ``lift_fresh`` on real tensors but not under
# fake tensors (the meta trace), so it is not counted: a meta profile counts what a real one does.
UNCOUNTED_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by overload packet name (``"addmm"``), except
    ``UNCOUNTED_OPS``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in UNCOUNTED_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def items(self) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(self.counts.items()))


class _SavedStorages:
    """What autograd saves for backward while ``fn()`` runs: the storages (data pointer -> bytes,
    those in ``exclude`` left out) and how many tensors it packs in all (every pack: what a
    ``torch.utils.checkpoint`` region pays a hook call for, Note [recompute cost])."""

    def __init__(self, fn: Callable[[], Any], exclude: Iterable[int] = ()) -> None:
        self.storages: dict[int, int] = {}
        self.packs = 0
        skip = set(exclude)

        def pack(t: torch.Tensor) -> torch.Tensor:
            self.packs += 1
            key = storage_key(t)  # Note [meta tracing]: meta storages have no address
            if key not in skip:
                self.storages[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.out = fn()


def _producer_saves_output(runner: UnitRunner, node: torch.fx.Node) -> bool:
    """Whether the node that made input ``node`` saves its own output for backward
    (run alone on its recorded inputs; Note [saved once])."""
    if node.op not in ("call_module", "call_function", "call_method"):
        return False
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, arg in enumerate(node.all_input_nodes):
        env[arg] = graph.placeholder(f"in_{i}")
    graph.output(graph.node_copy(node, lambda n: env[n]))
    values = [runner._values.get(arg) for arg in node.all_input_nodes]
    args, _ = fresh_copies(values, [True] * len(values))  # Note [fresh unit inputs]
    try:
        run = _SavedStorages(lambda: torch.fx.GraphModule(runner.gm, graph)(*args))
    except Exception:  # an op that cannot run alone: charge the input to the consumer as before
        return False
    return isinstance(run.out, torch.Tensor) and storage_key(run.out) in run.storages


def count_unit(runner: UnitRunner, ops: bool = True) -> UnitCounts:
    """Run the unit forward and backward once, counting FLOPs and saved activation bytes (and, with
    ``ops``, the dispatched aten ops, in a pass of their own).

    Note [saved once]: activation bytes are the storages autograd saves, each charged to
    ONE unit: a saved input of the unit is charged to the unit that made it when that
    unit's last op saves it too (ReLU saves its output, and the Linear after it saves
    the same tensor as its input), else to this unit. Charging both doubled the
    activations of every Linear/ReLU chain (measured in tests/runtime/test_memory.py).
    """
    state_ptrs = {storage_key(t) for t in runner.tensors}
    inputs = runner.fresh_inputs()  # outside the counting modes (Note [fresh unit inputs])
    input_ptrs = inputs.node_of_storage()

    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd:
        run = _SavedStorages(lambda: runner.run(inputs), state_ptrs)
    outputs, saved = run.out, run.storages
    for ptr in set(saved) & set(input_ptrs):
        if _producer_saves_output(runner, input_ptrs[ptr]):
            del saved[ptr]
    with bwd:
        has_backward = runner.backward(outputs, inputs.leaves)
    fwd_ops, bwd_ops = count_ops(runner) if ops else (OpCounter(), OpCounter())
    fresh = (
        runner.fresh_inputs()
    )  # again, differentiating the inputs only: the input-gradient FLOPs
    input_leaves = [x for x in fresh.leaves if not any(x is p for p in runner.params)]
    again = runner.run(fresh)
    with FlopCounterMode(display=False) as bwd_in:
        runner.backward(again, input_leaves)
    io_bytes = sum(nbytes(v) for v in runner.input_values.values()) + sum(
        nbytes(o) for o in outputs
    )
    return UnitCounts(
        fwd_flops=float(fwd.get_total_flops()),
        bwd_flops=float(bwd.get_total_flops()),
        fwd_bytes=io_bytes + sum(nbytes(t) for t in runner.tensors),
        activation_bytes=sum(saved.values()),
        n_ops=len(runner.nodes),
        has_backward=has_backward,
        fwd_ops=fwd_ops.items(),
        bwd_ops=bwd_ops.items(),
        bwd_input_flops=float(bwd_in.get_total_flops()),
        input_grads=bool(input_leaves),
        saved_tensors=run.packs,
    )


def count_ops(runner: UnitRunner) -> tuple[OpCounter, OpCounter]:
    """Aten ops of one forward and one backward, in a pass of their own: FlopCounterMode's
    module tracking dispatches views and detaches of its own that a real step does not."""
    inputs = runner.fresh_inputs()
    fwd_ops, bwd_ops = OpCounter(), OpCounter()
    with fwd_ops:
        outputs = runner.run(inputs)
    grads = [torch.ones_like(o) for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    with bwd_ops:
        has_backward = runner.backward(outputs, inputs.leaves, grads)
    if not has_backward:
        bwd_ops.counts.clear()
    elif runner.params:
        bwd_ops.counts[ACCUMULATE_OP] += len(runner.params)
    return fwd_ops, bwd_ops


def _value_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            value.dtype,
            value.requires_grad,
            isinstance(value, nn.Parameter),
        )
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    return ("value", repr(value))


def _node_key(
    gm: torch.fx.GraphModule, node: torch.fx.Node, local: dict[torch.fx.Node, int]
) -> Any:
    """A node as its operation and arguments, with input nodes by position in the unit (not by name)."""

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", local.get(a, -1))
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        return ("literal", repr(a))

    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        target: Any = (
            type(module),
            module.extra_repr(),
            module.training,
            tuple(_value_key(t) for t in list(module.parameters()) + list(module.buffers())),
        )
    elif node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        target = _value_key(getattr(gm.get_submodule(owner) if owner else gm, name))
    else:
        target = node.target
    return (node.op, target, arg(node.args), arg(node.kwargs), node.meta.get(GUARD_KEY))


def unit_structure_key(runner: UnitRunner) -> Any:
    """What a unit's counts depend on when its tensors hold no values: its operations and the shapes,
    dtypes and grad flags of its inputs and tensors, and the ops that made its inputs (Note [saved once]
    in :mod:`fxpipe.tracer.measure.counting`). Repeated layers of a model have equal keys (Note [meta tracing])."""
    gm = runner.gm
    local: dict[torch.fx.Node, int] = {}
    for node in list(runner.input_values) + runner.attr_nodes + runner.nodes:
        local[node] = len(local)
    producers = tuple(
        _node_key(gm, n, {a: i for i, a in enumerate(n.all_input_nodes)})
        if n.op != "placeholder"
        else ("placeholder",)
        for n in runner.input_values
    )
    inputs = tuple(_value_key(v) for v in runner.input_values.values())
    producer_inputs = tuple(
        tuple(_value_key(runner._values.get(a)) for a in n.all_input_nodes)
        for n in runner.input_values
    )
    body = tuple(_node_key(gm, n, local) for n in runner.attr_nodes + runner.nodes)
    values = tuple(_value_key(runner._values.get(n)) for n in runner.nodes)
    outputs = tuple(local[n] for n in runner.output_nodes)
    return (inputs, producers, producer_inputs, body, values, outputs)


def count_units_once(
    runners: list[UnitRunner],
    count: Callable[[UnitRunner], UnitCounts],
    progress: Callable[[list[UnitRunner]], Iterable[UnitRunner]],
) -> list[UnitCounts]:
    """``count(r)`` for each runner, run once per distinct :func:`unit_structure_key`: counts depend on
    the operations and the shapes only, so the 80 layers of a 70B model are counted once. The key holds
    the shape of every value inside the unit too, so a unit whose shapes follow its data (an MoE
    layer's routing) is counted again wherever they differ."""
    seen: dict[Any, UnitCounts] = {}
    out = []
    for runner in progress(runners):
        key = unit_structure_key(runner)
        if key not in seen:
            seen[key] = count(runner)
        out.append(seen[key])
    return out
