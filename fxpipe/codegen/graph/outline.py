"""Give a stage graph its module structure back: each whole module call becomes a submodule call.

Note [outlining module calls]: a traced graph is flat; ``nn_module_stack`` still says which
module call made each node (:mod:`fxpipe.codegen.graph.scopes`). A call that a stage holds
entirely, as one contiguous run of nodes, is moved into a graph of its own (its
``forward``) and replaced by ``call_module(path, inputs)``. Moving a contiguous run of
nodes into a function that receives the values it reads and returns the values read
after it is exact whatever the nodes are, so correctness never rests on the call being
"really" that module. Rules:

- deepest calls first, so a block's body already calls its attention as ``self.attn``;
- a call split across stages stays flat (its whole sub-calls are still outlined);
- size/shape nodes (no tensor data, no side effects) that sit inside a call's run but
  belong elsewhere are moved out of the way; other interleaving leaves the call flat;
- a size a call reads from outside is read inside from its own tensor input when that
  input's dimension is the same symbol (export's shapes say so), so identical layers get
  identical bodies; a device it reads (``x.device``) is read from its first tensor input, or a
  tensor it owns, so no body takes a ``device`` argument where it holds a tensor;
- a ``torch.nn`` layer whose call is exactly its own ``forward`` (e.g. one ``F.linear`` on
  its weight and bias) becomes that layer (:mod:`fxpipe.codegen.render.layers`); a one-node call that is not
  stays flat (``F.dropout(x, 0.0, True)`` reads better than a class around it);
- ``stack_runs`` turns consecutive calls of identical blocks ``h.2``, ``h.3``, ... chained
  output to input into one call of their container, which loops over them, or, where the
  container also holds a block split across stages, into a loop over the run's keys.
"""

from __future__ import annotations

import builtins
import inspect
import keyword
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.graphmeta import SPEC_KEY
from fxpipe.codegen.render.forward import base_name, run_blocks
from fxpipe.graphmeta import ARITY_KEY, GUARD_KEY, NAME_KEY
from fxpipe.codegen.render.layers import torch_layer_input
from fxpipe.codegen.render.naming import short_paths
from fxpipe.codegen.graph.scopes import Scope, scope_stack
from fxpipe.codegen.render.statements import SOURCE_NAME_KEY, STATEMENT_KEY, Statement, statement_at
from fxpipe.graphmeta import ORIGIN_KEY
from fxpipe.tracer.train_eval.modes import guard_of, is_training_flag
from fxpipe.tracer.profile import TensorSpec

__all__ = [
    "Body",
    "Outline",
    "outline_stage",
    "stack_runs",
    "is_metadata",
    "is_device",
    "size_inputs",
    "share_sizes",
]

_COMPUTE = ("call_function", "call_method", "call_module")
_SIZE_METHODS = ("size", "dim", "numel", "stride")
_INT_OPS = (
    operator.getitem,
    operator.add,
    operator.sub,
    operator.mul,
    operator.floordiv,
    operator.truediv,
    operator.mod,
    operator.neg,
)


@dataclass
class Body:
    """One outlined module call: where the module lives, its original class, and its forward graph."""

    path: str
    module_type: type
    graph: fx.Graph
    depth: int = 0  # how many module calls deep its forward runs (Note [names from the source])


@dataclass
class Outline:
    """A stage graph with its whole module calls outlined (the graph is changed in place)."""

    graph: fx.Graph
    bodies: dict[str, Body] = field(default_factory=dict)  # by module path, deepest first
    torch_layers: set[str] = field(
        default_factory=set
    )  # calls written as the torch.nn layer itself


def is_metadata(node: fx.Node) -> bool:
    """A node that reads only shapes/devices (no tensor data, no RNG, no side effects): safe to move."""
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op != "call_function":
        return False
    if node.target is getattr:
        return len(node.args) == 2 and node.args[1] in ("device", "shape", "dtype")
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._opname in ("sym_size", "sym_numel", "sym_stride")
    return node.target in _INT_OPS and not _is_tensor(node)


def _compute(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in _COMPUTE]


class _Outliner:
    def __init__(
        self,
        graph: fx.Graph,
        model: nn.Module,
        owned: set[str],
        original: Mapping[Scope, set[str]],
        leaves: set[str],
        is_subgraph: Callable[[str], bool],
        buildable: Callable[[str], bool],
    ) -> None:
        self.graph = graph
        self.model = model
        self.buildable = buildable
        self.stack: dict[fx.Node, tuple[Scope, ...]] = {}
        self.result = Outline(graph)
        self._hoist_attrs()
        nodes = _compute(graph)
        shorts = short_paths(str(n.target) for n in nodes if n.op == "call_module")
        for node in nodes:
            if node.op == "call_module":
                node.meta.setdefault(NAME_KEY, shorts[str(node.target)])
        for node in reversed(
            nodes
        ):  # users before the node: free nodes join their users' common scope
            origin = node.meta.get(ORIGIN_KEY)
            if origin is not None and origin in owned and scope_stack(node):
                self.stack[node] = scope_stack(node)
            elif origin is not None and origin in owned and not is_metadata(node):
                self.stack[node] = ()
            else:
                self.stack[node] = _common([self.stack.get(u, ()) for u in node.users])
        keys: dict[Scope, list[fx.Node]] = {}
        for node in nodes:
            for scope in self.stack[node]:
                keys.setdefault(scope, []).append(node)
        paths: dict[str, int] = {}
        for _, path in keys:
            paths[path] = paths.get(path, 0) + 1
        self.candidates = {
            s
            for s, ms in keys.items()
            if paths[s[1]] == 1
            and s[1] not in leaves
            and _module(model, s[1]) is not None
            and original.get(s, set()) <= owned
            and not any(
                a.op == "get_attr" and is_subgraph(str(a.target))
                for m in ms
                for a in m.all_input_nodes
            )
        }
        self.stack = {
            n: tuple(s for s in st if s in self.candidates) for n, st in self.stack.items()
        }

    def _hoist_attrs(self) -> None:
        """get_attr nodes first (after the placeholders): they are read where used, never computed."""
        anchor = next(
            (n for n in self.graph.nodes if n.op not in ("placeholder", "get_attr")), None
        )
        if anchor is None:
            return
        for node in list(self.graph.nodes):
            if node.op == "get_attr":
                anchor.prepend(node)

    def members(self, scope: Scope) -> list[fx.Node]:
        return [n for n in _compute(self.graph) if scope in self.stack.get(n, ())]

    def drop(self, scope: Scope) -> None:
        self.candidates.discard(scope)
        for node, st in self.stack.items():
            if scope in st:
                self.stack[node] = tuple(s for s in st if s != scope)

    def make_contiguous(self, scope: Scope) -> bool:
        """Move size nodes out of the scope's run; False when the run cannot be made contiguous."""
        members = self.members(scope)
        inside = set(members)
        order = _compute(self.graph)
        first, last = order.index(members[0]), order.index(members[-1])
        interlopers = [n for n in order[first : last + 1] if n not in inside]
        if not interlopers:
            return True
        if not all(is_metadata(n) for n in interlopers):
            return False
        after: set[fx.Node] = set()
        for n in order[first : last + 1]:
            if n not in inside and any(a in inside or a in after for a in n.all_input_nodes):
                after.add(n)
        if any(a in after for m in members for a in m.all_input_nodes):
            return False
        anchor = members[-1]
        for n in interlopers:
            if n in after:
                anchor.append(n)
                anchor = n
            else:
                members[0].prepend(n)
        return True

    def run(self) -> Outline:
        position = {n: i for i, n in enumerate(_compute(self.graph))}
        first: dict[Scope, int] = {}
        for node, stack in self.stack.items():
            for scope in stack:
                first[scope] = min(first.get(scope, len(position)), position[node])
        ordered = sorted(
            self.candidates, key=lambda s: (-len(s[1].split(".")), first[s])
        )  # deepest first
        for _ in range(2):  # make every run contiguous, or drop the scope
            for scope in ordered:
                if scope in self.candidates and not self.make_contiguous(scope):
                    self.drop(scope)
        for scope in ordered:
            if scope in self.candidates:
                self.outline(scope)
        return self.result

    def outline(self, scope: Scope) -> None:
        members = self.members(scope)
        path = scope[1]
        module = _module(self.model, path)
        assert module is not None
        inside = set(members)
        stack = self.stack[members[0]]
        parent = stack[: stack.index(scope)]
        attrs_inside = [
            a
            for a in _inputs(members)
            if is_training_flag(a) or (a.op == "get_attr" and str(a.target).startswith(path + "."))
        ]
        inputs = [a for a in _inputs(members) if a not in attrs_inside]
        outputs = [m for m in members if any(u not in inside for u in m.users)]
        guards = {guard_of(m) for m in members}
        if any(guard_of(o) is not None for o in outputs) and len(guards) > 1:
            self.drop(
                scope
            )  # a value of one mode leaves the call: it stays flat where its guard is written
            return
        input_guards = {guard_of(a) for a in inputs} - {None}
        if input_guards and (len(guards) > 1 or input_guards != guards):
            # a value of one mode enters a call made in both (SpecAugment's masked features into
            # Wav2Vec2's positional convolution): the other mode has no such value to pass
            self.drop(scope)
            return
        torch_input = torch_layer_input(
            members, module, path, {a for a in attrs_inside if not is_training_flag(a)}
        )
        if torch_input is not None and len(outputs) == 1 and self.buildable(path):
            self._replace(members, outputs, path, (torch_input,), parent, inputs + attrs_inside)
            self.result.torch_layers.add(path)
            return
        if len(members) == 1 and members[0].op != "call_module":
            self.drop(scope)  # one operator: clearer inline than behind a class
            return
        body = fx.Graph()
        env: dict[fx.Node, Any] = {}
        sizes = size_inputs(inputs)
        args = [a for a in inputs if a not in sizes]
        devices = [a for a in args if is_device(a)]
        device_source = next((a for a in args if a not in devices and _is_tensor(a)), None) or next(
            (a for a in attrs_inside if a.op == "get_attr" and _is_tensor(a)), None
        )
        if (
            device_source is not None
        ):  # read where the body runs: one of its tensors is on that device
            args = [a for a in args if a not in devices]
        else:
            devices = []
        for i, a in enumerate(args):
            ph = body.placeholder(f"arg{i}")
            ph.meta.update({k: v for k, v in a.meta.items() if k in ("val", SPEC_KEY)})
            ph.meta[NAME_KEY] = _first_parameter(module) if i == 0 and _is_tensor(a) else _name(a)
            env[a] = ph
        for a, (source, dim) in sizes.items():
            env[a] = body.call_method("size", (env[source], dim))
            env[a].meta.update({k: v for k, v in a.meta.items() if k in ("val", SPEC_KEY)})
            env[a].meta[NAME_KEY] = "size"
        for a in attrs_inside:
            env[a] = body.get_attr(str(a.target))  # a parameter, or the module's own training flag
            env[a].meta.update(a.meta)
        for a in devices:
            assert device_source is not None  # devices is empty without one
            env[a] = body.call_function(getattr, (env[device_source], "device"))
            env[a].meta.update({k: v for k, v in a.meta.items() if k in ("val", SPEC_KEY)})
            env[a].meta[NAME_KEY] = "device"
        for m in members:
            env[m] = body.node_copy(m, lambda x: env[x])
            if m.op == "call_module" and str(m.target).startswith(path + "."):
                env[m].meta[NAME_KEY] = str(m.target)[len(path) + 1 :].replace(".", "_")
        body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
        used = share_sizes(body)
        args = [a for a in args if used[env[a]]]
        for ph in [n for n in body.nodes if n.op == "placeholder" and not used[n]]:
            body.erase_node(ph)
        body.lint()
        depth = next(
            (scope_stack(m).index(scope) + 1 for m in members if scope in scope_stack(m)), 0
        )
        self.result.bodies[path] = Body(path, type(module), body, depth)
        self._replace(members, outputs, path, tuple(args), parent, inputs + attrs_inside)

    def _replace(
        self,
        members: list[fx.Node],
        outputs: list[fx.Node],
        path: str,
        args: tuple,
        parent: tuple[Scope, ...],
        read: list[fx.Node],
    ) -> None:
        """Put ``call_module(path, args)`` where the run of ``members`` was; drop what only the run read."""
        inside = set(members)
        with self.graph.inserting_before(members[0]):
            call = self.graph.call_module(path, args)
        guards = {guard_of(m) for m in members}
        if len(guards) == 1 and None not in guards:  # a call made in one mode only
            call.meta[GUARD_KEY] = guards.pop()
        parent_path = parent[-1][1] if parent else ""
        call.meta[NAME_KEY] = (
            path[len(parent_path) + 1 :] if parent_path else short_paths([path])[path]
        ).replace(".", "_")
        statement = _call_statement(members, path)
        if statement is not None:
            call.meta[STATEMENT_KEY] = statement
        self.stack[call] = parent
        if len(outputs) == 1:
            call.meta.update({k: v for k, v in outputs[0].meta.items() if k in ("val", SPEC_KEY)})
            outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in inside)
        else:
            call.meta[ARITY_KEY] = len(outputs)
            anchor = call
            for i, out in enumerate(outputs):
                with self.graph.inserting_after(anchor):
                    item = self.graph.call_function(operator.getitem, (call, i))
                item.meta.update(
                    {k: v for k, v in out.meta.items() if k in ("val", SPEC_KEY, GUARD_KEY)}
                )
                if statement is not None:
                    item.meta[STATEMENT_KEY] = statement
                self.stack[item] = parent
                out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
                anchor = item
        for m in reversed(members):
            self.graph.erase_node(m)
            del self.stack[m]
        for a in read:
            if not a.users and (a.op == "get_attr" or is_metadata(a)):
                self.graph.erase_node(a)
                self.stack.pop(a, None)


def _inputs(members: list[fx.Node]) -> list[fx.Node]:
    """Values the run reads from outside it, in order of first use."""
    inside = set(members)
    seen: dict[fx.Node, None] = {}
    for m in members:
        for a in m.all_input_nodes:
            if a not in inside:
                seen.setdefault(a, None)
    return list(seen)


def _common(stacks: list[tuple[Scope, ...]]) -> tuple[Scope, ...]:
    if not stacks:
        return ()
    common = stacks[0]
    for st in stacks[1:]:
        n = 0
        while n < min(len(common), len(st)) and common[n] == st[n]:
            n += 1
        common = common[:n]
    return common


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path else None
    except AttributeError:
        return None


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor) or isinstance(
        node.meta.get(SPEC_KEY), TensorSpec
    )


def _call_statement(members: list[fx.Node], path: str) -> Statement | None:
    """The line of the caller's forward that made the call at ``path``, which every node made inside the
    call records (the calls outlined before have no frames of their own)."""
    for m in members:
        stack = scope_stack(m)  # every call, not only the outlined ones: one frame each
        depth = next((i for i, sc in enumerate(stack) if sc[1] == path), None)
        statement = statement_at(m, depth) if depth is not None else None
        if statement is not None:
            return statement
    return None


def _first_parameter(module: nn.Module) -> str:
    """The name of ``module.forward``'s first parameter (``hidden_states``), or ``x`` where it has none
    that reads well (``input`` shadows a builtin)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "x"
    first = next(
        (p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None
    )
    if (
        first is None
        or not first.name.isidentifier()
        or keyword.iskeyword(first.name)
        or hasattr(builtins, first.name)
        or first.name.startswith("_")
    ):
        return "x"
    return first.name


def is_device(node: fx.Node) -> bool:
    """``t.device`` (Note [device literals] in :mod:`fxpipe.codegen.graph.split` makes them)."""
    return node.op == "call_function" and node.target is getattr and node.args[1:] == ("device",)


def _name(node: fx.Node) -> str:
    if node.meta.get(SOURCE_NAME_KEY):
        return str(node.meta[SOURCE_NAME_KEY])
    return base_name(str(node.meta.get(NAME_KEY) or node.name))


def _symbol(node: fx.Node) -> str | None:
    """The symbolic size (``"s77"``) a size node holds, when export's shapes tell it."""
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        return str(val)
    if (
        node.op == "call_method"
        and node.target == "size"
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
    ):
        shape = getattr(node.args[0].meta.get("val"), "shape", None)
        dim = node.args[1]
        if (
            shape is not None
            and isinstance(dim, int)
            and -len(shape) <= dim < len(shape)
            and isinstance(shape[dim], torch.SymInt)
        ):
            return str(shape[dim])
    return None


def _dims_of(node: fx.Node, symbol: str) -> list[int]:
    shape = getattr(node.meta.get("val"), "shape", ())
    return [
        d for d, size in enumerate(shape) if isinstance(size, torch.SymInt) and str(size) == symbol
    ]


def share_sizes(body: fx.Graph) -> dict[fx.Node, bool]:
    """Read every size from the first tensor argument that has it; return which placeholders are still used."""
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    tensors = [p for p in placeholders if _is_tensor(p)]
    for node in list(body.nodes):
        symbol = _symbol(node)
        if symbol is None or not (node.op == "call_method" and node.target == "size"):
            continue
        for t in tensors:
            dims = _dims_of(t, symbol)
            if dims:
                node.args = (t, dims[0])
                break
    return {p: bool(p.users) for p in placeholders}


def size_inputs(inputs: list[fx.Node]) -> dict[fx.Node, tuple[fx.Node, int]]:
    """Size inputs the body can read from one of its tensor inputs: ``{size node: (tensor input, dim)}``."""
    tensors = [a for a in inputs if _is_tensor(a)]
    found: dict[fx.Node, tuple[fx.Node, int]] = {}
    for a in inputs:
        if (
            a.op == "call_method"
            and a.target == "size"
            and len(a.args) == 2
            and a.args[0] in tensors
            and isinstance(a.args[1], int)
        ):
            found[a] = (a.args[0], a.args[1])  # type: ignore[assignment]
            continue
        symbol = _symbol(a)
        if symbol is None or not is_metadata(a):
            continue
        for t in tensors:
            dims = _dims_of(t, symbol)
            if dims:
                found[a] = (t, dims[0])
                break
    return found


def outline_stage(
    graph: fx.Graph,
    model: nn.Module,
    *,
    owned: set[str],
    original: Mapping[Scope, set[str]],
    leaves: set[str],
    is_subgraph: Callable[[str], bool],
    buildable: Callable[[str], bool],
) -> Outline:
    """Outline every whole module call of ``graph`` (changed in place); see Note [outlining module calls].

    ``owned``: names of the original nodes this stage holds; ``original``: every scope of the
    traced graph and its node names (a call is whole when all of them are owned);
    ``leaves``: module paths called as leaves (``call_module``); ``is_subgraph(target)``: whether
    a ``get_attr`` reads a higher-order op's subgraph (calls reading one stay flat); ``buildable(path)``:
    whether the ``torch.nn`` layer at ``path`` can be rebuilt from its hyperparameters.
    """
    return _Outliner(graph, model, owned, original, leaves, is_subgraph, buildable).run()


def stack_runs(
    graph: fx.Graph,
    class_of: Mapping[str, str],
    held: Callable[[str], list[str]],
    within: str | None = None,
) -> dict[str, list[str]]:
    """Replace runs of chained calls ``P.i(x, *rest)``, ``P.(i+1)(that, *rest)``, ... of one class by one call.

    ``within``: the module path whose forward ``graph`` is; its own children are never replaced by a
    call of itself (that module's class runs them).

    ``class_of``: the class name of each outlined path; ``held(P)``: the module paths directly
    under ``P`` that the stage holds. When the run is all of them it becomes ``P(x, *rest)``
    (``P`` is then a container that runs its blocks in order: returned as ``{P: run paths}``);
    a run of three or more inside a container that holds more becomes a loop over their keys
    (``forward.run_blocks``).
    """
    runs: dict[str, list[str]] = {}
    nodes = _compute(graph)
    i = 0
    while i < len(nodes):
        run = [nodes[i]]
        while i + len(run) < len(nodes) and _chains(run[-1], nodes[i + len(run)], run[0], class_of):
            run.append(nodes[i + len(run)])
        i += len(run)
        if len(run) < 2:
            continue
        container = str(run[0].target).rpartition(".")[0]
        if container == within:
            continue
        paths = [str(n.target) for n in run]
        whole = sorted(held(container)) == sorted(paths)
        if not container or (
            not whole and len(run) < 3
        ):  # the root is no container to loop over or call
            continue
        with graph.inserting_before(run[0]):
            if whole:
                call = graph.call_module(container, run[0].args)
            else:  # the container holds more (a block split across stages): loop over the run's keys
                first, last = (int(str(n.target).rpartition(".")[2]) for n in (run[0], run[-1]))
                call = graph.call_function(run_blocks, (container, first, last + 1, *run[0].args))
        call.meta.update({k: v for k, v in run[-1].meta.items() if k in ("val", SPEC_KEY)})
        call.meta[NAME_KEY] = container.rpartition(".")[2] or "layers"
        if STATEMENT_KEY in run[-1].meta:
            call.meta[STATEMENT_KEY] = run[-1].meta[STATEMENT_KEY]
        run[-1].replace_all_uses_with(call)
        for n in reversed(run):
            graph.erase_node(n)
        if whole:
            runs[container] = paths
    return runs


def _chains(prev: fx.Node, node: fx.Node, first: fx.Node, class_of: Mapping[str, str]) -> bool:
    if prev.op != "call_module" or node.op != "call_module" or prev.kwargs or node.kwargs:
        return False
    a, b = str(prev.target), str(node.target)
    pa, _, ia = a.rpartition(".")
    pb, _, ib = b.rpartition(".")
    return (
        pa == pb
        and ia.isdigit()
        and ib.isdigit()
        and int(ib) == int(ia) + 1
        and a in class_of
        and class_of.get(a) == class_of.get(b)
        and ARITY_KEY not in prev.meta
        and node.args[:1] == (prev,)
        and tuple(node.args[1:]) == tuple(first.args[1:])
        and list(prev.users) == [node]
    )
