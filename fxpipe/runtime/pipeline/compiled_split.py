"""A compiled region's backward as two compiled graphs: input gradients (``B``) and weight gradients (``W``).

``split_backend`` is a ``torch.compile`` backend: inductor's ``compile_fx`` with one change, at
the backward. AOTAutograd hands inductor one backward graph whose outputs are the gradients of
every input of the region, parameters included; ``split_backend`` cuts it in two
(``split_graph``) and compiles each half with inductor's own ``compile_fx_inner``:

- the *input half* computes the gradients of the inputs that are not parameters (the
  activations a pipeline stage sends back) and, as extra outputs, the intermediate values the
  weight half needs from it (the "boundary": an incoming gradient after a GELU's backward, say);
- the *weight half* computes the parameters' gradients from the backward graph's own inputs
  (saved activations, incoming gradients) and the boundary; nothing of the input half is
  computed again.

Note [deferring a compiled region's weight gradients]: AOTAutograd calls the compiled backward
from its autograd node (``CompiledFunctionBackward``) once per backward. ``SplitCode.__call__``
runs the input half, then:

- if the split backward armed it (``arm()``, from a pre-hook on that node in ``B``: Note [split
  backward through the saved graph] in ``fxpipe.runtime.pipeline.split_backward``), it returns
  ``None`` for the parameters' gradients and leaves a ``Deferred`` (the weight half and its
  arguments) for the node's post-hook to ``take()``; ``W`` runs it later and hands its gradients
  to the node's edges towards the parameters, as it does for any kept weight gradient;
- otherwise (a fused backward: 1F1B's ``B``, the warm-up, a node the split does not arm) it runs
  the weight half at once and returns every gradient, as the one-graph backward does.

The armed flag is process-wide, not thread-local: the autograd engine runs a CUDA node on its
device thread, and a node's pre-hook, its function and its post-hook run one after another
there. ``arm()`` holds for one node: the backward clears it, and so does ``take()``.

Which outputs are parameters' gradients: the backward graph's output node carries, per output,
AOTAutograd's descriptor (``GradAOTOutput(grad_of=PlainAOTInput(idx))``), ``idx`` the region's
flat input; ``split_backend`` sees those inputs (the real ``nn.Parameter`` objects Dynamo lifted)
and marks an output a weight gradient when its input is a parameter. The node's edge for an
output is its input's position among the tensor inputs (``Deferred.slots``); the post-hook
checks each such edge is off the input path and that the node produced nothing there, else it
runs the weight half at once and returns the full gradients (the fused behaviour; ``fallbacks``
counts it). The backward's symbolic inputs (saved SymInts) go to both halves: an input's shape
may name a symbol (``4*s0``) only they bind.

Used where ``--compile-backward halves`` (``PipelineRunner(compile_backward="halves")``,
``compile_module(..., split_graphs=True)``) asks for it under a split schedule: Note [compiled split backward] there
says what it measured.

AOTAutograd's cache (``enable_autograd_cache``) is off for these compiles: its entry would hold
the compiled backward, which is not one of inductor's serialisable graphs here. Inductor's FX
graph cache still caches both halves (and the forward) by their code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = [
    "Deferred",
    "SplitCode",
    "arm",
    "first_line",
    "split_backend",
    "split_failures",
    "split_graph",
    "stats",
    "take",
]


@dataclass
class Deferred:
    """A region's weight half, not run yet: ``run()`` gives the gradients for ``slots`` (the
    node's edge indices), in that order."""

    fn: Callable[[list[Any]], Sequence[Any]]
    args: list[Any]
    slots: list[int]

    def run(self) -> list[torch.Tensor | None]:
        args, self.args = self.args, []
        with torch.no_grad(), torch._C._DisableAutocast():  # as AOTAutograd runs a backward
            return list(self.fn(args))


class _State:
    armed: bool = False
    taken: Deferred | None = None


_STATE = _State()
stats = {"input_half": 0, "weight_half": 0, "deferred": 0, "fallbacks": 0, "restrided": 0}
# Note [the boundary's strides]: the weight half is compiled for the boundary tensors' strides in
# the backward graph, but inductor, compiling the input half, may lay an output out otherwise (a
# permuted channels-last product of the zoo's ConvNeXt came out with its last two strides
# swapped, failing the weight half's stride check); such a tensor is copied into the strides the
# weight half expects (nothing is copied where they agree, a dimension of size 1 aside). Strides
# that name a dynamic size (``(s0*32, 32, 1)``) are known only at run time; where the graph's
# layout is dense (its example sizes and strides, Dynamo's hints, say so), the weight half expects
# the dense strides of that dimension order at the run's sizes, and a tensor laid out otherwise is
# copied into them. A layout that is not dense (an expanded tensor: stride 0, a slice of a larger
# one) is not checked: the weight half's own check still stops such a run, with inductor's error.
# Note [halves that do not compile]: the halves are graphs inductor was not written for; where it
# cannot compile them, that region's backward is compiled as AOTAutograd's one graph instead (its
# B then computes the weight gradients too, as ``--compile-backward graph`` does), the reason kept
# here for the run log (``CompiledStage.one_graph``), rather than the run ending in the warm-up.
split_failures: list[str] = []


def first_line(error: BaseException) -> str:
    """The first non-blank line of ``error``'s message (a compiler's errors run to pages)."""
    return next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")


def arm() -> None:
    """The next compiled backward to run leaves its weight half for ``take()``."""
    _STATE.armed = True
    _STATE.taken = None


def take() -> Deferred | None:
    """What the last armed compiled backward left (None if none ran); disarms."""
    got, _STATE.taken, _STATE.armed = _STATE.taken, None, False
    return got


@dataclass
class _Plan:
    """How the two halves map onto the backward graph's inputs and outputs."""

    n_outputs: int
    input_half_args: list[int]  # backward-graph inputs the input half takes
    weight_half_args: list[int]  # ... the weight half takes (the boundary follows them)
    input_outputs: list[int]  # backward-graph output positions the input half computes
    weight_outputs: list[int]  # ... the weight half computes
    n_boundary: int
    # (position among the boundary, strides) of each boundary tensor whose strides are known
    # numbers: the weight half is compiled for them (Note [the boundary's strides])
    boundary_strides: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # (position, dims outermost first) of each dense one whose strides name a dynamic size
    boundary_orders: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


def _ancestors(outputs: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _subgraph(
    gm: fx.GraphModule, keep: set[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
) -> fx.GraphModule:
    """A graph of ``gm``'s nodes in ``keep``, with ``inputs`` as its placeholders (in order)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        p = g.placeholder(n.name)
        p.meta = dict(n.meta)
        env[n] = p
    for n in gm.graph.nodes:
        if n in env or n not in keep or n.op in ("placeholder", "output"):
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, g)


def split_graph(
    gm: fx.GraphModule, weight_outputs: set[int]
) -> tuple[fx.GraphModule, fx.GraphModule, _Plan] | None:
    """Cut backward graph ``gm`` into its input half and weight half (module docstring);
    ``weight_outputs``: the output positions that are parameters' gradients. None when one half
    would be empty (nothing to split)."""
    out_node = gm.graph.find_nodes(op="output")[0]
    outs = list(out_node.args[0])
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    pos = {p: i for i, p in enumerate(placeholders)}
    i_pos = [k for k, o in enumerate(outs) if isinstance(o, fx.Node) and k not in weight_outputs]
    w_pos = [k for k, o in enumerate(outs) if isinstance(o, fx.Node) and k in weight_outputs]
    if not i_pos or not w_pos:
        return None
    in_i = _ancestors([outs[k] for k in i_pos])
    in_w = _ancestors([outs[k] for k in w_pos])
    w_nodes = {n for n in in_w - in_i if n.op != "placeholder"}
    w_outs = {outs[k] for k in w_pos}
    # a node of several outputs the input half computes (a convolution's backward gives the input's
    # and the weight's gradients at once) crosses as the items the weight half reads: a graph's
    # outputs are tensors, not tuples (the zoo's Mamba, whose depthwise convolution does this)
    items = {
        u
        for n in in_i
        if isinstance(n.meta.get("val"), (tuple, list))
        for u in n.users
        if u in w_nodes
    }
    w_nodes -= items
    in_i |= items
    crossing = [  # what the weight half takes from the backward's inputs and from the input half
        n
        for n in gm.graph.nodes
        if n in in_w and n not in w_nodes and (n in w_outs or any(u in w_nodes for u in n.users))
    ]
    boundary = [n for n in crossing if n.op != "placeholder" and n in in_i]
    # the symbolic sizes (saved SymInts) go to both halves: an input's shape may name a symbol
    # (``4*s0``) that only they bind
    syms = {p for p in placeholders if not isinstance(p.meta.get("val"), torch.Tensor)}
    w_inputs = [p for p in placeholders if p in syms or p in set(crossing)]
    i_inputs = [p for p in placeholders if p in syms or p in in_i]
    dI = _subgraph(gm, in_i, i_inputs, [outs[k] for k in i_pos] + boundary)
    dW = _subgraph(gm, w_nodes, w_inputs + boundary, [outs[k] for k in w_pos])
    strides, orders = [], []  # Note [the boundary's strides]
    for j, v in enumerate(n.meta.get("val") for n in boundary):
        if not isinstance(v, torch.Tensor):
            continue
        if all(isinstance(x, int) and x > 0 for x in v.stride()):
            strides.append((j, tuple(v.stride())))
        elif (order := _dense_order(v)) is not None:
            orders.append((j, order))
    plan = _Plan(
        len(outs),
        [pos[p] for p in i_inputs],
        [pos[p] for p in w_inputs],
        i_pos,
        w_pos,
        len(boundary),
        strides,
        orders,
    )
    return dI, dW, plan


def dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dims, outermost first, are ``order``."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], step = step, step * shape[d]
    return tuple(strides)


def _dense_order(value: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of a graph's tensor with symbolic strides, outermost first, if its example sizes
    and strides (the symbols' hints) are those of a dense layout; None if not, or unknown."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    try:
        shape = [optimization_hint(n) for n in value.shape]
        stride = [optimization_hint(n) for n in value.stride()]
    except Exception:  # a size with no hint (data-dependent): unknown
        return None
    order = tuple(sorted(range(len(shape)), key=lambda d: -stride[d]))
    dense = dense_strides(shape, order)
    if any(n > 1 and s != w for n, s, w in zip(shape, stride, dense)):
        return None
    return order


def _restrided(x: torch.Tensor, want: Sequence[int]) -> torch.Tensor:
    """``x``, or a copy of it in strides ``want`` where its own differ (a size-1 dim aside)."""
    if not any(n > 1 and s != w for n, s, w in zip(x.shape, x.stride(), want)):
        return x
    stats["restrided"] += 1
    return torch.empty_strided(x.shape, tuple(want), dtype=x.dtype, device=x.device).copy_(x)


class SplitCode:
    """The compiled backward AOTAutograd calls (boxed: one list of arguments): the input half,
    then the weight half now or, armed, later (Note [deferring a compiled region's weight
    gradients])."""

    def __init__(
        self,
        input_half: Callable[[list[Any]], Sequence[Any]],
        weight_half: Callable[[list[Any]], Sequence[Any]],
        plan: _Plan,
        slots: list[int],
    ) -> None:
        self.input_half, self.weight_half, self.plan, self.slots = (
            input_half,
            weight_half,
            plan,
            slots,
        )
        self._boxed_call = True  # an instance attribute: AOTAutograd's wrappers copy __dict__

    def __call__(self, args: list[Any]) -> list[Any]:
        plan = self.plan
        i_args = [args[i] for i in plan.input_half_args]
        w_args = [args[i] for i in plan.weight_half_args]
        args.clear()
        got = list(self.input_half(i_args))
        stats["input_half"] += 1
        n_i = len(plan.input_outputs)
        out: list[Any] = [None] * plan.n_outputs
        for k, g in zip(plan.input_outputs, got[:n_i]):
            out[k] = g
        boundary = got[n_i:]
        for j, want in plan.boundary_strides:  # Note [the boundary's strides]
            boundary[j] = _restrided(boundary[j], want)
        for j, order in plan.boundary_orders:
            boundary[j] = _restrided(boundary[j], dense_strides(boundary[j].shape, order))
        w_args.extend(boundary)
        if _STATE.armed:
            _STATE.armed = False
            _STATE.taken = Deferred(self._weights, w_args, self.slots)
            stats["deferred"] += 1
            return out
        for k, g in zip(plan.weight_outputs, self._weights(w_args)):
            out[k] = g
        return out

    def _weights(self, args: list[Any]) -> Sequence[Any]:
        stats["weight_half"] += 1
        return self.weight_half(args)


def _weight_outputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, int]:
    """Output position -> the node edge (slot) of each parameter's gradient in backward ``gm``."""
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput

    out_node = gm.graph.find_nodes(op="output")[0]
    descs = out_node.meta.get("desc") or []
    tensor_slot: dict[int, int] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            tensor_slot[i] = len(tensor_slot)
    found: dict[int, int] = {}
    for k, d in enumerate(descs):
        if isinstance(d, GradAOTOutput) and isinstance(d.grad_of, PlainAOTInput):
            idx = d.grad_of.idx
            if idx < len(example_inputs) and isinstance(example_inputs[idx], nn.Parameter):
                found[k] = tensor_slot[idx]
    return found


def split_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """``torch.compile`` backend: inductor, the backward compiled as two halves."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    inputs = list(example_inputs)

    def inner(bw: fx.GraphModule, bw_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            return compile_fx_inner(bw, bw_inputs, **kwargs)
        weights = _weight_outputs(bw, inputs)
        cut = split_graph(bw, set(weights))
        if cut is None:
            return compile_fx_inner(bw, bw_inputs, **kwargs)
        dI, dW, plan = cut
        for half in (dI, dW):
            half.graph.find_nodes(op="output")[0].meta["user_visible_output_idxs"] = []
        halves_kwargs = {**kwargs, "static_input_idxs": []}
        i_in = [bw_inputs[i] for i in plan.input_half_args]
        w_in = [bw_inputs[i] for i in plan.weight_half_args]
        w_in += [n.meta.get("val") for n in dW.graph.find_nodes(op="placeholder")[len(w_in) :]]
        try:
            input_half = compile_fx_inner(dI, i_in, **halves_kwargs)
            weight_half = compile_fx_inner(dW, w_in, **halves_kwargs)
        except Exception as exc:  # Note [halves that do not compile]
            split_failures.append(f"{type(exc).__name__}: {first_line(exc)[:200]}")
            return compile_fx_inner(bw, bw_inputs, **kwargs)
        return SplitCode(input_half, weight_half, plan, [weights[k] for k in plan.weight_outputs])

    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner)
