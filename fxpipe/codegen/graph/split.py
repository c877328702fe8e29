"""Split a normalized traced graph into one ``torch.fx.Graph`` per pipeline stage.

Each stage graph holds copies of the nodes the plan gives that stage, a placeholder
for every value it receives (from an earlier stage or as a model input) and an output
tuple of the values that later stages or the model's output need. A tensor may skip
stages: it travels straight from its producer to each consumer.

Note [values that cross stages]: only tensors travel between stages. A non-tensor
value (a size such as ``x.size(0)`` or export's ``sym_size.int``) needed by a later
stage is recomputed there: from the same tensor when the stage has it, as a literal
when its shape formula is a constant (Note [shape formulas] in :mod:`fxpipe.shapeformula`;
without formulas, when it is a non-batch dimension), or from any tensor the stage has
(model inputs are free: every rank reads the batch) with a dimension of the same symbol
(``mb``, ``seq``; without formulas, the batch dimension of the same size). Only when none of these works is it sent as a 0-d int64 tensor named
``<node>_tensor`` and turned back into an int with ``.item()``.

Note [device literals]: export bakes the trace device into calls such as
``arange(..., device=device(type='cpu'))``. The splitter rewrites every
``torch.device`` argument into ``<tensor>.device`` of a tensor the stage already has,
so a stage runs wherever its inputs and parameters live.

Note [modes across stages]: the ``training`` flag of a merged graph (Note [both modes in
one graph] in :mod:`fxpipe.tracer.train_eval.modes`) is each stage's own ``self.training``, copied into
every stage that reads it. A value guarded for one mode exists only in that mode, so it may
not cross a stage boundary (the tracer keeps each guarded region in one unit; a plan that
splits one is refused here).

Boundary tensors are named after the module call they come from (``h_3_out``; see
:mod:`fxpipe.codegen.render.naming`), the same in every stage and in the manifest.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx

from fxpipe.graphmeta import SPEC_KEY, PATH_KEY
from fxpipe.graphmeta import MUTATIONS_KEY, NAME_KEY
from fxpipe.codegen.manifest import INPUT, BoundaryTensor
from fxpipe.codegen.render.naming import boundary_names
from fxpipe.codegen.render.statements import record_frames
from fxpipe.graphmeta import ORIGIN_KEY
from fxpipe.errors import CodegenError
from fxpipe.shapeformula import UNKNOWN
from fxpipe.tracer.train_eval.modes import TRAINING_ATTR, guard_of, is_training_flag
from fxpipe.tracer.profile import TensorSpec

__all__ = ["StageGraph", "SplitGraph", "split_graph", "int_tensor_name"]

_SYM_SIZE = torch.ops.aten.sym_size.int


def int_tensor_name(node_name: str) -> str:
    """Boundary name of a non-tensor value sent as a 0-d int64 tensor (see Note [values that cross stages])."""
    return f"{node_name}_tensor"


@dataclass(frozen=True)
class StageGraph:
    """One stage's graph and what it needs from outside.

    ``inputs`` / ``outputs`` are boundary names (see ``naming.boundary_names``) in the order of the
    stage graph's placeholders / output tuple. ``modules`` are the leaf module paths it
    calls, ``attrs`` the ``get_attr`` targets it reads (parameters, buffers, constants,
    higher-order-op subgraphs), ``nodes`` the original call nodes it owns, ``mutated`` the
    inputs it changes in place, which it must be given as copies of its own (Note [in-place
    ops across stages] in :mod:`fxpipe.tracer.frontend.mutation`).
    """

    index: int
    graph: fx.Graph
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    modules: tuple[str, ...]
    attrs: tuple[str, ...]
    nodes: tuple[str, ...]
    mutated: tuple[str, ...] = ()


@dataclass(frozen=True)
class SplitGraph:
    """All stage graphs plus the boundary tensors between them (by name); ``sources`` maps the name of each
    tensor a stage sends to the traced node that computes it (to say which unit made a tensor that is off)."""

    stages: tuple[StageGraph, ...]
    boundary: Mapping[str, BoundaryTensor]
    model_inputs: tuple[str, ...]
    sources: Mapping[str, str] = field(default_factory=dict)


def _spec(node: fx.Node) -> Any:
    return node.meta.get(SPEC_KEY)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(_spec(node), TensorSpec)


def _size_args(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(tensor, dim)`` when ``node`` reads one dimension of a tensor's size, else None."""
    if node.op == "call_function" and node.target is _SYM_SIZE:
        t, d = node.args[0], node.args[1]
    elif node.op == "call_method" and node.target == "size" and len(node.args) == 2:
        t, d = node.args
    elif (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and isinstance(node.args[1], int)
    ):
        src = node.args[0]
        if src.op == "call_method" and src.target == "size" and len(src.args) == 1:
            t, d = src.args[0], node.args[1]
        elif src.op == "call_function" and src.target is getattr and src.args[1:] == ("shape",):
            t, d = src.args[0], node.args[1]
        else:
            return None
    else:
        return None
    if isinstance(t, fx.Node) and isinstance(d, int) and _is_tensor(t):
        return t, d % max(len(_spec(t).shape), 1)
    return None


def _formula(t: fx.Node, d: int) -> str | None:
    """Dimension ``d`` of tensor ``t`` as a formula of the dynamic sizes, when the trace fitted one."""
    dims = _spec(t).dims
    if dims is None or dims[d] == UNKNOWN:
        return None
    return str(dims[d])


def _same_symbol(a: fx.Node, da: int, b: fx.Node, db: int) -> bool:
    """Whether dim ``da`` of ``a`` and dim ``db`` of ``b`` are the same batch-scaled size."""
    sa, sb = _spec(a), _spec(b)
    if sa.batch_dim != da or sb.batch_dim != db or sa.shape[da] != sb.shape[db]:
        return False
    va, vb = a.meta.get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        return str(va.shape[da]) == str(vb.shape[db])
    return True


class _Splitter:
    """Builds all stage graphs; see the module notes for the rules it follows."""

    def __init__(
        self,
        gm: fx.GraphModule,
        stage_of: Mapping[str, int],
        num_stages: int,
        attr_name: Callable[[str, Iterable[str]], str] | None,
    ) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output = next(n for n in self.nodes if n.op == "output")
        self.attr_name = attr_name
        self.num_stages = num_stages
        self.stage_of: dict[fx.Node, int] = {}
        for n in self.nodes:
            if n.op in ("call_function", "call_method", "call_module"):
                if n.name not in stage_of:
                    raise CodegenError(
                        f"node {n.name!r} ({n.format_node()}) has no stage; the plan must place "
                        "every unit of the traced model"
                    )
                s = stage_of[n.name]
                if not 0 <= s < num_stages:
                    raise CodegenError(
                        f"node {n.name!r} is placed on stage {s}, expected 0..{num_stages - 1}"
                    )
                self.stage_of[n] = s
        crossing = {
            a.name
            for n, s in self.stage_of.items()
            for a in n.all_input_nodes
            if self.stage_of.get(a, s) != s
        }
        crossing.update(a.name for a in self.output.all_input_nodes)
        self.names = boundary_names(gm, crossing)
        self.graphs = [fx.Graph() for _ in range(num_stages)]
        self.env: list[dict[fx.Node, Any]] = [{} for _ in range(num_stages)]
        self.imports: list[dict[fx.Node, fx.Node]] = [{} for _ in range(num_stages)]
        self.int_imports: list[dict[fx.Node, fx.Node]] = [{} for _ in range(num_stages)]
        self.attrs: list[dict[str, None]] = [{} for _ in range(num_stages)]
        self.modules: list[dict[str, None]] = [{} for _ in range(num_stages)]

    # -- values a stage reads ------------------------------------------------------

    def bname(self, a: fx.Node) -> str:
        """The boundary name of original node ``a``."""
        return self.names.get(a.name, a.name)

    def _placeholder(self, s: int, name: str, like: fx.Node | None) -> fx.Node:
        ph = self.graphs[s].placeholder(name)
        ph.meta[NAME_KEY] = name
        if like is not None:
            ph.meta.update({k: v for k, v in like.meta.items() if k in (SPEC_KEY, PATH_KEY, "val")})
        return ph

    def value(self, s: int, a: fx.Node) -> Any:
        """The node (or int literal) in stage ``s`` that holds original value ``a``, created on first use."""
        env = self.env[s]
        if a in env:
            return env[a]
        g = self.graphs[s]
        if is_training_flag(
            a
        ):  # the stage's own flag: no tensor to own (Note [modes across stages])
            env[a] = g.create_node("get_attr", TRAINING_ATTR)
            env[a].meta.update(a.meta)
        elif a.op == "get_attr":
            target = str(a.target)
            if self.attr_name is not None:
                paths = [u.meta.get(PATH_KEY, "") for u in a.users if self.stage_of.get(u) == s]
                target = self.attr_name(target, paths)
            env[a] = g.get_attr(target)
            env[a].meta.update(a.meta)
            self.attrs[s][target] = None
        elif a.op == "placeholder" or _is_tensor(a):
            env[a] = self._placeholder(s, self.bname(a), a)
            self.imports[s][a] = env[a]
        else:
            env[a] = self._recompute_int(s, a)
        return env[a]

    def _available(self, s: int, t: fx.Node) -> bool:
        return t in self.env[s] or t.op == "placeholder"

    def _recompute_int(self, s: int, a: fx.Node) -> Any:
        """A non-tensor value from another stage, rebuilt in stage ``s`` (Note [values that cross stages])."""
        producer = self.stage_of.get(a)
        if producer is None or producer == s:
            raise CodegenError(f"value {a.name!r} ({a.format_node()}) has no producing stage")
        spec = _spec(a)
        if isinstance(spec, tuple):
            raise CodegenError(
                f"tuple value {a.name!r} crosses from stage {producer} to stage {s}; "
                "the tracer must keep a tuple and its getitem nodes in one unit"
            )
        g = self.graphs[s]
        size = _size_args(a)
        if size is not None:
            t, d = size
            if self._available(s, t):
                return self._size_node(s, a, self.value(s, t), d)
            formula = _formula(t, d)
            if formula is not None:  # Note [shape formulas] in fxpipe.shapeformula
                found = self._with_symbol(s, formula) if formula.isidentifier() else None
                if formula.isdigit():
                    return int(formula)  # a dimension that never changes
                if found is not None:
                    return self._size_node(s, a, self.value(s, found[0]), found[1])
            elif _spec(t).batch_dim != d:
                return int(_spec(t).shape[d])  # a non-batch dimension never changes (no formulas)
            for c in self._tensors_of(s):
                bd = _spec(c).batch_dim
                if bd is not None and _same_symbol(t, d, c, bd):
                    return self._size_node(s, a, self.value(s, c), bd)
        elif all(
            not isinstance(x, fx.Node) or not _is_tensor(x) or self._available(s, x)
            for x in a.all_input_nodes
        ):
            return self.graphs[s].node_copy(a, lambda x: self.value(s, x))
        ph = self._placeholder(s, int_tensor_name(self.bname(a)), None)
        self.int_imports[s][a] = ph
        return g.create_node("call_method", "item", (ph,), name=a.name)

    def _tensors_of(self, s: int) -> list[fx.Node]:
        """The tensors stage ``s`` has and the model's inputs (free: every rank reads the batch), in
        program order: where a size it needs may be read from."""
        return sorted(
            (
                n
                for n in list(self.env[s]) + self.placeholders
                if n.op != "get_attr" and _is_tensor(n)
            ),
            key=self.order.__getitem__,
        )

    def _with_symbol(self, s: int, symbol: str) -> tuple[fx.Node, int] | None:
        """A tensor stage ``s`` has (or a model input) with a dimension that is exactly ``symbol``."""
        for c in self._tensors_of(s):
            dims = _spec(c).dims
            if dims is not None and symbol in dims:
                return c, dims.index(symbol)
        return None

    def _size_node(self, s: int, like: fx.Node, tensor: fx.Node, dim: int) -> fx.Node:
        g = self.graphs[s]
        if like.op == "call_function" and like.target is _SYM_SIZE:
            return g.create_node("call_function", _SYM_SIZE, (tensor, dim), name=like.name)
        return g.create_node("call_method", "size", (tensor, dim), name=like.name)

    # -- building ------------------------------------------------------------------

    def run(self) -> SplitGraph:
        for n, s in self.stage_of.items():
            for a in n.all_input_nodes:
                if a in self.stage_of and self.stage_of[a] > s:
                    raise CodegenError(
                        f"the plan is not in dependency order: {a.name!r} on stage {self.stage_of[a]} feeds "
                        f"{n.name!r} on stage {s}; a partition must send values only to later stages"
                    )
                if a in self.stage_of and self.stage_of[a] != s and guard_of(a) is not None:
                    mode = "train" if guard_of(a) else "eval"
                    raise CodegenError(
                        f"{a.name!r} runs in {mode} mode only, so it cannot be sent from stage {self.stage_of[a]} "
                        f"to {n.name!r} on stage {s}; the plan must keep a mode-guarded region on one stage"
                    )
        for s in range(self.num_stages):
            owned = [n for n in self.nodes if self.stage_of.get(n) == s]
            for n in owned:  # declare the tensor inputs first so sizes can be read from them
                for a in n.all_input_nodes:
                    if a.op == "placeholder" or (
                        _is_tensor(a) and a in self.stage_of and self.stage_of[a] != s
                    ):
                        self.value(s, a)
            for n in owned:
                copy = self.graphs[s].node_copy(n, functools.partial(self.value, s))
                copy.meta[ORIGIN_KEY] = n.name
                if n.op == "call_module":
                    self.modules[s][str(n.target)] = None
                self.env[s][n] = copy
        outputs = self._collect_outputs()
        self._finish(outputs)
        return self._result(outputs)

    def _collect_outputs(self) -> list[dict[fx.Node, list[int]]]:
        """Per producing stage: original value -> model-output indices (may be empty)."""
        outs: list[dict[fx.Node, list[int]]] = [{} for _ in range(self.num_stages)]
        last = self.num_stages - 1
        flat = self.output.args[0]
        if not isinstance(flat, (tuple, list)):
            raise CodegenError(
                "the traced graph must return a flat tuple of tensors (normalized graph)"
            )
        for k, v in enumerate(flat):
            if not isinstance(v, fx.Node):
                raise CodegenError(
                    f"model output {k} is the constant {v!r}; only tensor outputs are supported"
                )
            s = self.stage_of.get(v, last)
            if v not in self.stage_of:
                self.value(last, v)
            outs[s].setdefault(v, []).append(k)
        for s in range(self.num_stages):
            for a in list(self.imports[s]) + list(self.int_imports[s]):
                p = self.stage_of.get(a)
                if p is not None:
                    outs[p].setdefault(a, [])
        return outs

    def _finish(self, outputs: list[dict[fx.Node, list[int]]]) -> None:
        for s, g in enumerate(self.graphs):
            values = []
            for a in sorted(outputs[s], key=self.order.__getitem__):
                if (
                    any(a in self.imports[c] for c in range(self.num_stages))
                    or outputs[s][a]
                    or a not in self.stage_of
                ):
                    values.extend([self.env[s][a]] * max(1, len(outputs[s][a])))
                if any(a in self.int_imports[c] for c in range(self.num_stages)):
                    values.append(
                        g.call_function(
                            torch.tensor,
                            (self.env[s][a],),
                            {"dtype": torch.int64},
                            name=int_tensor_name(self.bname(a)),
                        )
                    )
            g.output(tuple(values))
            self._sort_placeholders(s)
            _rewrite_devices(g)
            record_frames(
                g
            )  # what names its values (Note [names from the source]); the trace text goes
            for node in g.nodes:
                node.meta.pop("stack_trace", None)
            g.lint()

    def _sort_placeholders(self, s: int) -> None:
        g = self.graphs[s]
        key: dict[fx.Node, float] = {ph: self.order[a] for a, ph in self.imports[s].items()}
        key.update({ph: self.order[a] + 0.5 for a, ph in self.int_imports[s].items()})
        first = next((n for n in g.nodes if n.op != "placeholder"), None)
        for ph in sorted(key, key=key.__getitem__):
            if first is not None:
                first.prepend(ph)

    def _input_names(self, s: int) -> list[str]:
        entries: list[tuple[float, str]] = [(self.order[a], self.bname(a)) for a in self.imports[s]]
        entries += [
            (self.order[a] + 0.5, int_tensor_name(self.bname(a))) for a in self.int_imports[s]
        ]
        return [name for _, name in sorted(entries)]

    def _mutated(self, s: int) -> tuple[str, ...]:
        """The boundary names of the tensors stage ``s`` receives and changes in place."""
        changed = self.gm.meta.get(MUTATIONS_KEY, {})
        hit = {
            a for n, stage in self.stage_of.items() if stage == s for a in changed.get(n.name, ())
        }
        return tuple(
            self.bname(a)
            for a in sorted(self.imports[s], key=self.order.__getitem__)
            if a.name in hit
        )

    def _result(self, outputs: list[dict[fx.Node, list[int]]]) -> SplitGraph:
        boundary: dict[str, BoundaryTensor] = {}
        sources: dict[str, str] = {}
        stage_outputs: list[list[str]] = [[] for _ in range(self.num_stages)]
        for s in range(self.num_stages):
            for a in sorted(outputs[s], key=self.order.__getitem__):
                if a in self.stage_of:
                    sources[self.bname(a)] = sources[int_tensor_name(self.bname(a))] = a.name
                consumers = tuple(c for c in range(self.num_stages) if a in self.imports[c])
                spec = _spec(a)
                indices = outputs[s][a]
                if consumers or indices or a not in self.stage_of:
                    # a model input or attribute returned as is is keyed apart from the input itself
                    name = self.bname(a)
                    key = name if a in self.stage_of else f"{name}@{indices[0]}"
                    boundary[key] = _boundary(
                        name, spec, s, consumers, indices[0] if indices else None
                    )
                    stage_outputs[s].append(key)
                    for k in indices[1:]:
                        stage_outputs[s].append(f"{name}@{k}")
                        boundary[f"{name}@{k}"] = _boundary(name, spec, s, (), k)
                int_consumers = tuple(c for c in range(self.num_stages) if a in self.int_imports[c])
                if int_consumers:
                    name = int_tensor_name(self.bname(a))
                    boundary[name] = BoundaryTensor(
                        name=name,
                        shape=(),
                        dtype="int64",
                        batch_dim=None,
                        producer=s,
                        consumers=int_consumers,
                        requires_grad=False,
                    )
                    stage_outputs[s].append(name)
        for ph in self.placeholders:
            consumers = tuple(c for c in range(self.num_stages) if ph in self.imports[c])
            boundary[self.bname(ph)] = _boundary(self.bname(ph), _spec(ph), INPUT, consumers, None)
        stages = tuple(
            StageGraph(
                index=s,
                graph=self.graphs[s],
                inputs=tuple(self._input_names(s)),
                outputs=tuple(stage_outputs[s]),
                modules=tuple(self.modules[s]),
                attrs=tuple(self.attrs[s]),
                nodes=tuple(n.name for n in self.nodes if self.stage_of.get(n) == s),
                mutated=self._mutated(s),
            )
            for s in range(self.num_stages)
        )
        return SplitGraph(
            stages=stages,
            boundary=boundary,
            model_inputs=tuple(self.bname(p) for p in self.placeholders),
            sources=sources,
        )


def _boundary(
    name: str, spec: Any, producer: int, consumers: tuple[int, ...], model_output: int | None
) -> BoundaryTensor:
    if not isinstance(spec, TensorSpec):
        raise CodegenError(
            f"value {name!r} crosses a stage boundary but is not a tensor (spec {spec!r})"
        )
    return BoundaryTensor(
        name=name,
        shape=spec.shape,
        dtype=spec.dtype,
        batch_dim=spec.batch_dim,
        producer=producer,
        consumers=consumers,
        requires_grad=spec.requires_grad,
        model_output=model_output,
        dims=spec.dims,
    )


def _rewrite_devices(g: fx.Graph, is_tensor: Callable[[fx.Node], bool] = _is_tensor) -> None:
    """Replace ``torch.device`` literals by ``<tensor>.device`` (Note [device literals])."""
    users = [n for n in g.nodes if n.op != "output" and _has_device(n.args, n.kwargs)]
    if not users:
        return
    source = next((n for n in g.nodes if n.op == "placeholder" and is_tensor(n)), None)
    if source is None:
        source = next((n for n in g.nodes if n.op == "get_attr" and is_tensor(n)), None)
    if source is None:
        return  # nothing on this stage tells the device; keep the traced one
    first = next(n for n in g.nodes if n.op != "placeholder")
    if source.op == "get_attr" and source is not first:
        first.prepend(source)
        first = source
    insert = g.inserting_after(source) if source.op == "get_attr" else g.inserting_before(first)
    with insert:
        dev = g.call_function(getattr, (source, "device"), name="device")

    def swap(x: Any) -> Any:
        return dev if isinstance(x, torch.device) else x

    for n in users:
        n.args = fx.node.map_aggregate(n.args, swap)
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)


def _has_device(args: Any, kwargs: Any) -> bool:
    found = []
    fx.node.map_aggregate(
        (args, kwargs), lambda x: found.append(x) if isinstance(x, torch.device) else x
    )
    return bool(found)


def split_graph(
    gm: fx.GraphModule,
    stage_of_node: Mapping[str, int],
    num_stages: int,
    attr_name: Callable[[str, Iterable[str]], str] | None = None,
) -> SplitGraph:
    """Split a normalized traced graph into ``num_stages`` stage graphs.

    ``stage_of_node`` maps every call node's name to its stage (get_attr and
    placeholder nodes are copied into whichever stages read them). ``attr_name(target,
    user_paths)`` may rename a ``get_attr`` target per stage (to give a tied parameter
    the key of the module that reads it there). Raises CodegenError when the assignment sends a value to an
    earlier stage or leaves a node unplaced.
    """
    if num_stages < 1:
        raise CodegenError(f"num_stages must be >= 1, got {num_stages}")
    for sub in (
        gm.modules()
    ):  # the subgraphs of higher-order ops (autocast, no_grad regions) bake devices too
        if sub is not gm and isinstance(sub, fx.GraphModule):
            _rewrite_devices(sub.graph, lambda n: isinstance(n.meta.get("val"), torch.Tensor))
            sub.recompile()
    return _Splitter(gm, stage_of_node, num_stages, attr_name).run()
