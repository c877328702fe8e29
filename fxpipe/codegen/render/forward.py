"""Render a ``torch.fx.Graph`` as the body of a ``forward`` method that reads like hand-written PyTorch.

torch.fx's own code generation spells functions by their C binding (``torch._C._nn.linear``),
indexes with ``slice(None, None, None)`` and binds every parameter to a local first. This
renderer writes operators infix (``a + b``), indexing with slice syntax (``x[:, :t]``),
``torch.nn.functional`` as ``F``, parameters where they are used (``self.ln.weight``),
unpacks tuples (``q, k, v = x.split(32, 2)``), gives a name back to a later value once its
value is dead (``hidden_states = self.norm(hidden_states)``, as people write it), and drops a
value after its last use (``x = None``) where that lowers the function's peak memory (Note
[frees that matter] in :mod:`fxpipe.codegen.render.frees`; torch.fx drops every value).

Variable names come from ``node.meta[NAME_KEY]`` when set, else the node's name.

Where train and eval mode differ (Note [both modes in one graph] in :mod:`fxpipe.tracer.train_eval.modes`)
the graph reads ``self.training``; nodes guarded for one mode are written under
``if self.training:`` / ``if not self.training:`` (consecutive ones in one block), and a value
that differs is ``a if self.training else b``.
"""

from __future__ import annotations

import builtins
import enum
import keyword
import operator
import re
from typing import Any, Callable

import torch
import torch.fx as fx

from fxpipe.graphmeta import SPEC_KEY
from fxpipe.graphmeta import ARITY_KEY, NAME_KEY
from fxpipe.codegen.render.frees import Bytes, plan_frees
from fxpipe.codegen.render.naming import unique_name
from fxpipe.codegen.render.pyrender import ImportTable, render_literal
from fxpipe.errors import CodegenError
from fxpipe.tracer.train_eval.modes import guard_of, is_training_flag, train_or_eval

__all__ = ["render_forward", "render_function", "run_blocks", "base_name", "GeneratedFunction"]


_BINARY = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.floordiv: "//",
    operator.mod: "%",
    operator.pow: "**",
    operator.matmul: "@",
    operator.and_: "&",
    operator.or_: "|",
    operator.xor: "^",
    operator.lshift: "<<",
    operator.rshift: ">>",
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}
_RESERVED = (
    frozenset(dir(builtins))
    | frozenset(keyword.kwlist)
    | {"self", "torch", "F", "math", "operator", "os", "i"}
)
_SIMPLE = re.compile(r"^[\w.]+$|^\w[\w.]*\[[^\[\]]*\]$")


def run_blocks(container: Any, start: int, stop: int, x: Any, *args: Any) -> Any:
    """``x`` through ``container[str(i)](x, *args)`` for ``i`` in ``range(start, stop)``: a node target the
    renderer writes as that ``for`` loop (``outline.stack_runs``)."""
    for i in range(start, stop):
        x = container[str(i)](x, *args)
    return x


def _names_a_host_function(fn: Any) -> bool:
    """Whether ``fn`` is an operator whose first argument names the Python function it calls
    (``fxpipe::host_mask_indices``: Note [masks drawn on the host])."""
    return isinstance(fn, torch._ops.OpOverload) and fn.name() == "fxpipe::host_mask_indices"


class GeneratedFunction:
    """The target of a call of a generated module-level function (Note [helper calls] in
    :mod:`fxpipe.codegen.render.functions`): ``graph`` is its body, ``name`` what the build calls it (set when it
    is written, ``wanted`` until then). The renderer writes the call as ``name(args)``."""

    def __init__(self, wanted: str, graph: fx.Graph) -> None:
        self.wanted = wanted
        self.name = wanted
        self.graph = graph
        self.__name__ = wanted

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError(
            f"{self.name} is written into the stage source, not run while building it"
        )

    def __repr__(self) -> str:
        return f"<generated function {self.name}>"


def base_name(name: str) -> str:
    """``view_12`` -> ``view``: a node name without FX's numeric suffix."""
    return re.sub(r"(_\d+)+$", "", name) or name


class _Names:
    """Unique, valid, non-shadowing variable names."""

    def __init__(self, reserved: set[str]) -> None:
        self.used = set(_RESERVED) | reserved

    @staticmethod
    def clean(wanted: str) -> str:
        name = re.sub(r"\W", "_", wanted) or "v"
        return f"v_{name}" if name[0].isdigit() else name

    def take(self, wanted: str) -> str:
        return unique_name(self.clean(wanted), self.used, first=1)


def _arity(node: fx.Node) -> int | None:
    if ARITY_KEY in node.meta:
        return int(node.meta[ARITY_KEY])
    for key in ("val", SPEC_KEY):
        value = node.meta.get(key)
        if isinstance(value, (tuple, list)):
            return len(value)
    return None


def _unpacked(node: fx.Node) -> list[fx.Node | None] | None:
    """The getitem users of ``node`` by position, when its value can be written as ``a, b = ...``."""
    n = _arity(node)
    if n is None or not node.users:
        return None
    slots: list[fx.Node | None] = [None] * n
    for user in node.users:
        if not (
            user.op == "call_function"
            and user.target is operator.getitem
            and user.args[0] is node
            and isinstance(user.args[1], int)
            and 0 <= user.args[1] < n
            and slots[user.args[1]] is None
        ):
            return None
        slots[user.args[1]] = user
    return slots


class _Renderer:
    def __init__(
        self,
        graph: fx.Graph,
        imports: ImportTable,
        attr: Callable[[str], str],
        reserved: set[str],
        arg_names: list[str] | None,
        workspace: Callable[[fx.Node], Bytes | None] | None = None,
    ) -> None:
        self.graph = graph
        self.workspace = workspace
        self.peak: Bytes = (0, 0)
        self.imports = imports
        self.attr = attr
        self.names: dict[fx.Node, str] = {}
        self.inline: dict[fx.Node, str] = {}
        self.functions = {
            n: self.function(n.target)
            for n in graph.nodes
            if n.op == "call_function"
            and n.target not in _BINARY
            and n.target not in _UNARY
            and n.target
            not in (operator.getitem, operator.setitem, getattr, run_blocks, train_or_eval)
        }
        namer = _Names(
            reserved | {ref.split(".")[0].split("(")[0] for ref in self.functions.values()}
        )
        given = iter(arg_names or ())
        nodes = list(graph.nodes)
        at = {
            n: i for i, n in enumerate(nodes)
        }  # where each value is assigned: an unpacked item at its tuple's line
        for node in nodes:
            for slot in _unpacked(node) or ():
                if slot is not None:
                    at[slot] = at[node]
        last = {n: max((at[u] for u in n.users), default=-1) for n in nodes}
        holders: dict[str, fx.Node] = {}  # name -> the value it holds now
        for node in nodes:
            if is_training_flag(node):
                self.inline[node] = "self.training"
            elif node.op == "get_attr":
                self.inline[node] = attr(str(node.target))
            elif _mode_literal(node):
                self.inline[node] = self.expr(node)
            elif node.op == "placeholder" and arg_names is not None:
                self.names[node] = namer.take(next(given))
                holders[self.names[node]] = node
            elif node.op != "output":
                wanted = namer.clean(self._wanted(node))
                held = holders.get(wanted)
                if held is not None and _may_rebind(held, node, last[held] <= at[node]):
                    self.names[node] = wanted
                else:
                    self.names[node] = namer.take(wanted)
                holders[self.names[node]] = node

    def _wanted(self, node: fx.Node) -> str:
        if NAME_KEY in node.meta:
            return str(node.meta[NAME_KEY])
        source = node.args[0] if node.args else None
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(source, fx.Node)
            and source in self.names
            and isinstance(node.args[1], int)
        ):
            return f"{self.names[source]}_{node.args[1]}"
        return base_name(node.name)

    # -- expressions ----------------------------------------------------------------

    def value(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            return self.inline.get(a) or self.names[a]
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            items = [self.value(x) for x in a]
            if isinstance(a, list):
                return "[" + ", ".join(items) + "]"
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.value(k)}: {self.value(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.value(a.start)}, {self.value(a.stop)}, {self.value(a.step)})"
        return self.literal(a)

    def literal(self, a: Any) -> str:
        if a is Ellipsis:
            return "..."
        if isinstance(a, (torch.layout, torch.memory_format)):
            return f"torch.{str(a).removeprefix('torch.')}"
        if isinstance(a, enum.Enum) and type(a).__module__.startswith("torch"):
            return f"{self.imports.ref(type(a))}.{a.name}"
        return render_literal(a, self.imports)

    def index(self, idx: Any) -> str:
        def one(i: Any) -> str:
            if isinstance(i, slice):
                parts = ["" if p is None else self.value(p) for p in (i.start, i.stop)]
                return ":".join(parts) + ("" if i.step is None else f":{self.value(i.step)}")
            return self.value(i)

        if (
            isinstance(idx, tuple)
            and len(idx) == 1
            and (isinstance(idx[0], (slice, int)) or idx[0] in (None, ...))
        ):
            return one(idx[0])  # x[(slice(a, b),)] is x[a:b]
        if isinstance(idx, tuple):
            return ", ".join(one(i) for i in idx) + ("," if len(idx) == 1 else "") if idx else "()"
        return one(idx)

    def operand(self, a: Any) -> str:
        text = self.value(a)
        return (
            text if _SIMPLE.match(text) or (isinstance(a, (int, float)) and a >= 0) else f"({text})"
        )

    def call_args(self, args: tuple, kwargs: dict) -> str:
        parts = [self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def function(self, fn: Any) -> str:
        if isinstance(fn, GeneratedFunction):
            return fn.name
        if isinstance(
            fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
        ):
            return self.imports.op(fn)
        if (
            getattr(fn, "__module__", None) == "_operator"
        ):  # operator.iadd(a, b), not `from _operator import iadd`
            self.imports.modules.add("operator")
            return f"operator.{fn.__name__}"
        ref = self.imports.ref(fn)
        if ref.startswith("torch.nn.functional."):
            self.imports.functional = True
            return "F." + ref.removeprefix("torch.nn.functional.")
        return ref

    def expr(self, node: fx.Node) -> str:
        args, kwargs = node.args, node.kwargs
        if node.op == "call_module":
            return f"{self.attr(str(node.target))}({self.call_args(args, kwargs)})"
        if node.op == "call_method":
            return f"{self.operand(args[0])}.{node.target}({self.call_args(args[1:], kwargs)})"
        if node.op != "call_function":
            raise CodegenError(f"cannot render node {node.format_node()}")
        fn = node.target
        if fn in _BINARY and len(args) == 2 and not kwargs:
            return f"{self.operand(args[0])} {_BINARY[fn]} {self.operand(args[1])}"
        if fn in _UNARY and len(args) == 1 and not kwargs:
            return f"{_UNARY[fn]}{self.operand(args[0])}"
        if fn is operator.getitem and len(args) == 2 and not kwargs:
            return f"{self.operand(args[0])}[{self.index(args[1])}]"
        if (
            fn is operator.setitem and len(args) == 3 and not kwargs and not node.users
        ):  # a statement
            return f"{self.operand(args[0])}[{self.index(args[1])}] = {self.value(args[2])}"
        if fn is getattr and len(args) == 2 and isinstance(args[1], str) and args[1].isidentifier():
            return f"{self.operand(args[0])}.{args[1]}"
        if fn is train_or_eval and len(args) == 3 and not kwargs:
            return f"{self.operand(args[1])} if {self.value(args[0])} else {self.operand(args[2])}"
        if _names_a_host_function(fn) and args and isinstance(args[0], str):
            # the mask function of a model file: named as the stage's own import of that file
            rest = self.call_args(args[1:], kwargs)
            call_args = self.imports.model_function_name(args[0]) + (", " + rest if rest else "")
            return f"{self.function(fn)}({call_args})"
        return f"{self.functions.get(node) or self.function(fn)}({self.call_args(args, kwargs)})"

    # -- statements -----------------------------------------------------------------

    def body(self) -> tuple[list[str], list[str]]:
        """(argument names, lines of the body)."""
        nodes = list(self.graph.nodes)
        last_use: dict[fx.Node, fx.Node] = {}
        for node in nodes:
            for a in node.all_input_nodes:
                if a in self.names:
                    last_use[a] = node
        kept = self._frees(nodes, last_use)
        freed: dict[fx.Node, list[str]] = {}
        for value, user in last_use.items():
            if value in kept:
                freed.setdefault(user, []).append(self.names[value])
        params: list[str] = []
        lines: list[str] = []
        guards: list[
            bool | None
        ] = []  # per line: the mode it runs in (Note [both modes in one graph])
        skipped: set[fx.Node] = set()
        for i, node in enumerate(nodes):
            if node.op == "placeholder":
                params.append(self.names[node])
                continue
            if node.op == "get_attr" or node in skipped or node in self.inline:
                continue
            if node.op == "output":
                ret = self._return(node, lines, nodes[i - 1] if i else None, guards)
                guards = guards[: len(lines)]
                lines.append(ret)
                guards.append(None)
                continue
            guard = guard_of(node)
            if node.op == "call_function" and node.target is run_blocks:
                lines += self._loop(node, freed.get(node, []))
                guards += [guard] * (len(lines) - len(guards))
                continue
            slots = _unpacked(node)
            if slots is not None:
                skipped.update(s for s in slots if s is not None)
                targets = ", ".join("_" if s is None else self.names[s] for s in slots)
                line = f"{targets}{',' if len(slots) == 1 else ''} = {self.expr(node)}"
                taken = {self.names[node]} | {self.names[s] for s in slots if s is not None}
                frees = [
                    n
                    for n in freed.get(node, [])
                    + [n for s in slots if s is not None for n in freed.get(s, [])]
                    if n not in taken
                ]
            elif node.users:
                line = f"{self.names[node]} = {self.expr(node)}"
                frees = [
                    n for n in freed.get(node, []) if n != self.names[node]
                ]  # a name it takes again
            else:
                line = self.expr(node)
                frees = freed.get(node, [])
            if frees:
                line += f";  {' = '.join(frees)} = None"
            lines.append(line)
            guards.append(guard)
        return params, _guarded(lines, guards)

    def _frees(self, nodes: list[fx.Node], last_use: dict[fx.Node, fx.Node]) -> set[fx.Node]:
        """The values to free after their last use: those the modelled peak needs (Note [frees that matter])."""
        statements: list[fx.Node] = []
        position: dict[fx.Node, int] = {}
        unpacked: set[fx.Node] = set()
        for node in nodes:
            if (
                node.op in ("placeholder", "output", "get_attr")
                or node in self.inline
                or node in position
            ):
                continue
            position[node] = len(statements)
            slots = (
                None
                if node.op == "call_function" and node.target is run_blocks
                else _unpacked(node)
            )
            if slots is not None:
                unpacked.add(node)
                position.update((s, len(statements)) for s in slots if s is not None)
            statements.append(node)
        natural: dict[
            fx.Node, int
        ] = {}  # where a value is let go without a free: its name is taken again
        holder: dict[str, fx.Node] = {}
        for node in nodes:
            if node not in position or node in unpacked or not node.users:
                continue
            name = self.names[node]
            if name in holder and holder[name] is not node:
                natural.setdefault(holder[name], position[node])
            holder[name] = node
        end = len(statements)

        def released(value: fx.Node) -> int:
            if value in unpacked or not value.users:
                return position[value]
            return natural.get(value, end)

        candidates = {
            v: position[u] for v, u in last_use.items() if u.op != "output" and u in position
        }
        plan = plan_frees(self.graph, statements, position, candidates, released, self.workspace)
        self.peak = plan.peak
        return set(plan.kept)

    def _loop(self, node: fx.Node, frees: list[str]) -> list[str]:
        """``run_blocks`` as the loop it stands for; what it frees is freed after the loop."""
        container, start, stop, x, *rest = node.args
        name, first = self.names[node], self.value(x)
        call = ", ".join([name] + [self.value(a) for a in rest])
        head = (
            []
            if name == first
            else [f"{name} = {first}" + (f";  {first} = None" if first in frees else "")]
        )
        lines = head + [
            f"for i in range({start}, {stop}):",
            f"    {name} = {self.attr(str(container))}[str(i)]({call})",
        ]
        after = [f for f in frees if f not in (first, name)]
        return lines + ([f"{' = '.join(after)} = None"] if after else [])

    def _return(
        self, node: fx.Node, lines: list[str], previous: fx.Node | None, guards: list[bool | None]
    ) -> str:
        out = node.args[0]
        if (
            isinstance(out, fx.Node)
            and out is previous
            and len(out.users) == 1
            and out in self.names
            and lines
            and guards[-1] is None
            and lines[-1].startswith(f"{self.names[out]} = ")
            and ";" not in lines[-1]
        ):
            return "return " + lines.pop()[len(self.names[out]) + 3 :]
        return f"return {self.value(out)}"


def _may_rebind(held: fx.Node, node: fx.Node, dead: bool) -> bool:
    """Whether ``node`` may take the name of ``held``, as hand-written code reassigns ``hidden_states``:
    ``held`` is read no more after ``node``'s line (``dead``), neither runs in one mode only, and a
    ``run_blocks`` loop, which reads its other arguments on every pass, takes only its input's name."""
    if (
        not dead
        or node.op == "placeholder"
        or guard_of(held) is not None
        or guard_of(node) is not None
    ):
        return False
    if node.op == "call_function" and node.target is run_blocks:
        return len(node.args) > 3 and node.args[3] is held
    return True


def _mode_literal(node: fx.Node) -> bool:
    """``not self.training`` or ``a if self.training else b`` of literals: written where it is used."""
    if node.op != "call_function" or not any(is_training_flag(a) for a in node.args[:1]):
        return False
    if node.target is operator.not_:
        return len(node.args) == 1
    return node.target is train_or_eval and not any(isinstance(a, fx.Node) for a in node.args[1:])


def _guarded(lines: list[str], guards: list[bool | None]) -> list[str]:
    """Lines of one mode under ``if self.training:`` / ``if not self.training:``, consecutive ones in one block."""
    out: list[str] = []
    current: bool | None = None
    for line, guard in zip(lines, guards):
        if guard is not None and guard != current:
            out.append("if self.training:" if guard else "if not self.training:")
        current = guard
        out.append(line if guard is None else "    " + line)
    return out


def render_forward(
    graph: fx.Graph,
    imports: ImportTable,
    attr: Callable[[str], str],
    *,
    reserved: set[str] | None = None,
    arg_names: list[str] | None = None,
    workspace: Callable[[fx.Node], Bytes | None] | None = None,
) -> list[str]:
    """``def forward(self, ...):`` and its body, one source line per list item (indented 4 within the def).

    ``attr(target)`` writes a ``get_attr`` / ``call_module`` target as an expression
    (e.g. ``self.h["3"].attn``); ``arg_names`` overrides the names of the arguments;
    ``workspace(node)``: the modelled peak of a call of a generated class (Note [frees that matter]).
    """
    return render_function(
        graph, imports, attr, reserved=reserved, arg_names=arg_names, workspace=workspace
    )[0]


def render_function(
    graph: fx.Graph,
    imports: ImportTable,
    attr: Callable[[str], str],
    *,
    reserved: set[str] | None = None,
    arg_names: list[str] | None = None,
    workspace: Callable[[fx.Node], Bytes | None] | None = None,
    name: str = "forward",
    method: bool = True,
) -> tuple[list[str], Bytes]:
    """``render_forward``'s lines and the modelled peak of the function (Note [frees that matter]); ``name`` and
    ``method``: ``def name(...)`` without ``self`` for a module-level function."""
    renderer = _Renderer(graph, imports, attr, (reserved or set()) | {name}, arg_names, workspace)
    params, lines = renderer.body()
    head = ", ".join((["self"] if method else []) + params)
    return [f"def {name}({head}):", *("    " + ln for ln in lines)], renderer.peak
