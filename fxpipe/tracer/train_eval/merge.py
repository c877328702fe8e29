"""Merge a model's train-mode and eval-mode graphs into one graph that reads ``self.training``.

Note [aligning two traces]: both graphs are normalized traces of the same forward, so the
eval graph is the train graph with a few differences (measured on the zoo): literals that
flip (``dropout(x, p, True)`` vs ``False``, batch norm's ``training``), a ``p`` that is ``0.0`` in
eval mode (SDPA's ``dropout_p``), train-only copies that keep the value (``contiguous``),
train-only side effects (BatchNorm's ``num_batches_tracked.add_(1)``) and train-only
subgraphs whose result replaces a value in eval mode (stochastic depth inlined:
``x * noise`` vs ``x``). Eval nodes are matched to train nodes by data flow, in program
order: an eval node matches the next train node with the same operation, target and module
path whose arguments are the matched values (seen through train-only value-preserving
copies) and equal literals, allowing a flipped flag or a ``p`` against ``0``. When none is
that exact, the nearest one whose differing arguments are values of one mode only is taken,
and the difference becomes ``train_or_eval(training, a, b)``; an eval node with no match at
all is kept, guarded for eval mode. Train nodes that nothing matched are guarded for train mode.

The merged graph is exact by construction, whatever the matching found: restricted to one
mode it runs that mode's nodes in that mode's program order with that mode's arguments
(random ops therefore draw in the original order), plus pure nodes whose values are the
same in both modes. The matching only decides how much is shared, i.e. how readable the
stages are. See Note [both modes in one graph] in :mod:`fxpipe.tracer.train_eval.modes` for the form.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx

from fxpipe.errors import TraceError
from fxpipe.graphmeta import CONSTANTS_KEY, GUARD_KEY, PATH_KEY
from fxpipe.tracer.train_eval.modes import TRAINING_ATTR, train_or_eval

__all__ = ["merge_modes", "MergeSummary"]

_COMPUTE = ("call_function", "call_method", "call_module")
_aten = torch.ops.aten
_VALUE_PRESERVING = {_aten.contiguous.default, _aten.clone.default, _aten.alias.default}
_VALUE_PRESERVING_METHODS = {"contiguous", "clone"}
_PURE_FUNCTIONS = {
    operator.getitem,
    getattr,
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.neg,
    operator.pos,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    operator.xor,
    operator.not_,
    operator.invert,
    operator.matmul,
}
_PURE_METHODS = {
    "size",
    "dim",
    "numel",
    "stride",
    "view",
    "reshape",
    "contiguous",
    "transpose",
    "permute",
}
_LOOKAHEAD = 64  # compute nodes searched past a near match for an exact one

Loc = tuple[str, Any]  # ("arg", index) or ("kw", name)


@dataclass(frozen=True)
class MergeSummary:
    """How the two modes differ in the merged graph (node counts), for messages and tests."""

    train_only: int
    eval_only: int
    switched: int  # arguments that read the mode (flags, p vs 0, values of one mode)

    @property
    def same(self) -> bool:
        return not (self.train_only or self.eval_only or self.switched)


@dataclass(frozen=True)
class _Diff:
    loc: Loc
    path: tuple[int, ...]
    train: Any
    eval: Any


# -- arguments by name ------------------------------------------------------------------------------------------------


def _slots(node: fx.Node) -> dict[Any, tuple[Loc, Any]] | None:
    """``{key: (location, value)}`` for every argument, defaults filled in where the signature says them."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        out: dict[Any, tuple[Loc, Any]] = {}
        for i, a in enumerate(target._schema.arguments):
            if i < len(args) and not a.kwarg_only:
                out[a.name] = (("arg", i), args[i])
            elif a.name in kwargs:
                out[a.name] = (("kw", a.name), kwargs[a.name])
            elif a.has_default_value():
                out[a.name] = (("kw", a.name), a.default_value)
        return out if set(kwargs) <= set(out) else None
    if node.op == "call_function" and callable(target):
        try:
            params = list(inspect.signature(target).parameters.values())
        except (TypeError, ValueError):
            params = []
        plain = params and all(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params
        )
        if plain and len(args) <= len(params):
            out = {}
            for i, p in enumerate(params):
                if i < len(args) and p.kind != p.KEYWORD_ONLY:
                    out[p.name] = (("arg", i), args[i])
                elif p.name in kwargs:
                    out[p.name] = (("kw", p.name), kwargs[p.name])
                elif p.default is not p.empty:
                    out[p.name] = (("kw", p.name), p.default)
            if set(kwargs) <= set(out):
                return out
    raw: dict[Any, tuple[Loc, Any]] = {("arg", i): (("arg", i), a) for i, a in enumerate(args)}
    raw.update({("kw", k): (("kw", k), v) for k, v in kwargs.items()})
    return raw


def _replace(value: Any, path: tuple[int, ...], new: Any) -> Any:
    if not path:
        return new
    items = list(value)
    items[path[0]] = _replace(items[path[0]], path[1:], new)
    return tuple(items) if isinstance(value, tuple) else items


def _set_argument(node: fx.Node, loc: Loc, path: tuple[int, ...], new: Any) -> None:
    kind, key = loc
    if kind == "arg":
        args = list(node.args)
        args[key] = _replace(args[key], path, new)
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[key] = _replace(kwargs.get(key), path, new)
        node.kwargs = kwargs


# -- what a node is ---------------------------------------------------------------------------------------------------


def _value_preserving(node: fx.Node) -> bool:
    """A copy whose value and gradient are its first argument's (``contiguous``, ``clone``, ``alias``)."""
    if node.op == "call_function":
        return node.target in _VALUE_PRESERVING and len(node.args) >= 1
    return (
        node.op == "call_method"
        and node.target in _VALUE_PRESERVING_METHODS
        and len(node.args) == 1
    )


def _pure(node: fx.Node) -> bool:
    """No side effect and no random numbers: running it again, or in the other mode too, changes nothing."""
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return not t._schema.is_mutable and torch.Tag.nondeterministic_seeded not in t.tags
        return t in _PURE_FUNCTIONS
    return node.op == "call_method" and node.target in _PURE_METHODS


def _metadata(node: fx.Node) -> bool:
    """Reads a size or another property of a tensor's metadata, never its data."""
    if node.op == "call_method":
        return node.target in ("size", "dim", "numel", "stride")
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._opname in ("sym_size", "sym_numel", "sym_stride")
    return (
        node.target is getattr
        and len(node.args) == 2
        and node.args[1] in ("shape", "dtype", "device", "ndim")
    )


def _flat(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def _literal_step(train: Any, eval_: Any) -> bool:
    """Literals that may differ in an exact match: a flipped flag, or a number against zero (``p`` vs ``0.0``)."""
    if isinstance(train, bool) and isinstance(eval_, bool):
        return True
    numbers = (int, float)
    return (
        isinstance(train, numbers)
        and isinstance(eval_, numbers)
        and not isinstance(train, bool)
        and not isinstance(eval_, bool)
        and (train == 0 or eval_ == 0)
    )


def _literal_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            isinstance(a, list) == isinstance(b, list)
            and len(a) == len(b)
            and all(_literal_equal(x, y) for x, y in zip(a, b))
        )
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. tensors compared elementwise
        return a is b


class _Merger:
    def __init__(self, train: fx.GraphModule, eval_: fx.GraphModule) -> None:
        self.gm, self.eval_gm = train, eval_
        self.graph = train.graph
        self.t_nodes = [n for n in self.graph.nodes if n.op in _COMPUTE]
        self.t_index = {n: i for i, n in enumerate(self.t_nodes)}
        self.t_attrs: dict[str, fx.Node] = {}
        for (
            n
        ) in self.graph.nodes:  # the first read of each attribute: defined before every later use
            if n.op == "get_attr":
                self.t_attrs.setdefault(str(n.target), n)
        self.m: dict[fx.Node, Any] = {}  # eval node -> merged node
        self.common: set[fx.Node] = set()  # train nodes that run in both modes
        self.eval_only: set[fx.Node] = set()
        self.fixups: list[tuple[fx.Node, list[_Diff]]] = []
        self.pointer = 0
        self.flag: fx.Node | None = None
        self.switched = 0
        self.train_only: set[fx.Node] = set()
        self.position: dict[fx.Node, int] = {}

    # -- matching -----------------------------------------------------------------------------------------------------

    def _unmatched(self, n: fx.Node) -> bool:
        return n in self.t_index and n not in self.common

    def _same_value(self, ta: fx.Node, ea: fx.Node, marks: list[fx.Node], depth: int = 0) -> bool:
        """Whether train value ``ta`` is the merged value ``ea`` in both modes (appending the train nodes that
        must then run in both modes to ``marks``)."""
        if ta is ea:
            return True
        n, chain = ta, []
        while (
            n is not ea
            and self._unmatched(n)
            and _value_preserving(n)
            and isinstance(n.args[0], fx.Node)
        ):
            chain.append(n)
            n = n.args[0]
        if n is ea:
            marks.extend(chain)
            return True
        if (
            depth > 4
            or ea.op != ta.op
            or ea.target != ta.target
            or not _pure(ta)
            or not _pure(ea)
            or ea in self.eval_only
            or len(ta.args) != len(ea.args)
            or set(ta.kwargs) != set(ea.kwargs)
        ):
            return False
        inner: list[fx.Node] = []
        pairs = list(
            zip(
                _flat(tuple(ta.args) + tuple(ta.kwargs.values())),
                _flat(tuple(ea.args) + tuple(ea.kwargs[k] for k in ta.kwargs)),
            )
        )
        for a, b in pairs:
            if isinstance(a, fx.Node) and isinstance(b, fx.Node):
                if not self._same_value(a, b, inner, depth + 1):
                    return False
            elif isinstance(a, fx.Node) or isinstance(b, fx.Node) or not _literal_equal(a, b):
                return False
        marks.extend(inner + ([ta] if self._unmatched(ta) else []))
        return True

    def _compare(
        self,
        ta: Any,
        ea: Any,
        loc: Loc,
        path: tuple[int, ...],
        exact: bool,
        diffs: list[_Diff],
        marks: list[fx.Node],
    ) -> bool:
        """Compare one argument; append what differs to ``diffs``; False when the node cannot match."""
        if (
            isinstance(ta, (list, tuple))
            and isinstance(ea, (list, tuple))
            and len(ta) == len(ea)
            and isinstance(ta, list) == isinstance(ea, list)
            and not hasattr(ta, "_fields")
        ):
            return all(
                self._compare(a, b, loc, path + (i,), exact, diffs, marks)
                for i, (a, b) in enumerate(zip(ta, ea))
            )
        if isinstance(ta, fx.Node) and isinstance(ea, fx.Node):
            if self._same_value(ta, ea, marks):
                return True
            if exact or not (self._train_only_candidate(ta) or ea in self.eval_only):
                return False
        elif isinstance(ta, fx.Node) or isinstance(ea, fx.Node):
            if exact:
                return False
        elif _literal_equal(ta, ea):
            return True
        elif exact and not _literal_step(ta, ea):
            return False
        diffs.append(_Diff(loc, path, ta, ea))
        return True

    def _train_only_candidate(self, n: fx.Node) -> bool:
        return self._unmatched(n) and self.t_index[n] >= self.pointer

    def _match(
        self, t: fx.Node, e: fx.Node, exact: bool
    ) -> tuple[list[_Diff], list[fx.Node]] | None:
        if (
            t.op != e.op
            or t.target != e.target
            or t.meta.get(PATH_KEY, "") != e.meta.get(PATH_KEY, "")
        ):
            return None
        ts, es = _slots(t), _slots(e)
        if ts is None or es is None or set(ts) != set(es):
            return None
        diffs: list[_Diff] = []
        marks: list[fx.Node] = []
        for key, (loc, tv) in ts.items():
            ev = fx.node.map_arg(es[key][1], lambda a: self.m[a])
            if not self._compare(tv, ev, loc, (), exact, diffs, marks):
                return None
        return diffs, marks

    def _find(self, e: fx.Node) -> tuple[fx.Node, list[_Diff], list[fx.Node]] | None:
        near: tuple[fx.Node, list[_Diff], list[fx.Node]] | None = None
        limit = len(self.t_nodes)
        for i in range(self.pointer, len(self.t_nodes)):
            if i > limit:
                break
            t = self.t_nodes[i]
            if t in self.common:
                continue
            found = self._match(t, e, exact=True)
            if found is not None:
                return t, *found
            if near is None:
                found = self._match(t, e, exact=False)
                if found is not None:
                    near = (t, *found)
                    limit = i + _LOOKAHEAD
        return near

    def _map_attr(self, e: fx.Node) -> fx.Node:
        value = _fetch(self.eval_gm, str(e.target))
        same = self.t_attrs.get(str(e.target))
        if same is None or _fetch(self.gm, str(e.target)) is not value:
            same = next(
                (
                    t
                    for t in self.t_attrs.values()
                    if _same_attr(_fetch(self.gm, str(t.target)), value)
                ),
                None,
            )
        if same is not None:
            return same
        name, i = f"_fxpipe_eval_{str(e.target).replace('.', '_')}", 0
        while hasattr(self.gm, f"{name}_{i}"):
            i += 1
        self.gm.register_buffer(f"{name}_{i}", value, persistent=False) if isinstance(
            value, torch.Tensor
        ) else self.gm.add_module(f"{name}_{i}", value)
        if isinstance(value, torch.Tensor):
            self.gm.meta.setdefault(CONSTANTS_KEY, set()).add(f"{name}_{i}")
        first = next(n for n in self.graph.nodes if n.op not in ("placeholder",))
        with self.graph.inserting_before(first):
            node = self.graph.get_attr(f"{name}_{i}")
        node.meta.update(e.meta)
        self.t_attrs[str(node.target)] = node
        return node

    def walk(self) -> None:
        t_ph = [n for n in self.graph.nodes if n.op == "placeholder"]
        e_ph = [n for n in self.eval_gm.graph.nodes if n.op == "placeholder"]
        if len(t_ph) != len(e_ph):
            raise TraceError(
                f"the model takes {len(t_ph)} inputs in train mode but {len(e_ph)} in eval mode"
            )
        self.m.update(zip(e_ph, t_ph))
        for e in self.eval_gm.graph.nodes:
            if e.op == "get_attr":
                self.m[e] = self._map_attr(e)
            elif e.op in _COMPUTE:
                found = self._find(e)
                if found is None:
                    self._eval_only(e)
                    continue
                t, diffs, marks = found
                self.m[e] = t
                self.common.add(t)
                self.common.update(marks)
                self.pointer = self.t_index[t] + 1
                if diffs:
                    self.fixups.append((t, diffs))

    def _eval_only(self, e: fx.Node) -> None:
        anchor = (
            self.t_nodes[self.pointer]
            if self.pointer < len(self.t_nodes)
            else next(n for n in self.graph.nodes if n.op == "output")
        )
        with self.graph.inserting_before(anchor):
            node = self.graph.node_copy(e, lambda a: self.m[a])
        node.meta[GUARD_KEY] = False
        self.m[e] = node
        self.eval_only.add(node)

    # -- rewriting ------------------------------------------------------------------------------------------------------

    def training(self) -> fx.Node:
        if self.flag is None:
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            with self.graph.inserting_before(first):
                self.flag = self.graph.create_node("get_attr", TRAINING_ATTR)
            self.flag.meta[PATH_KEY] = ""
        return self.flag

    def _mode_value(self, train: Any, eval_: Any, user: fx.Node) -> fx.Node:
        """The node that is ``train`` in train mode and ``eval_`` in eval mode, for ``user``.

        A switch between two values sits right after the later of them and belongs to the module of
        the one-mode value it chooses (so it joins that value's unit and module call); a literal
        switch sits right before its user."""
        flag = self.training()
        if train is True and eval_ is False:
            return flag
        values = [v for v in (train, eval_) if isinstance(v, fx.Node)]
        owner = next((v for v in values if v in self.eval_only or v in self.train_only), user)
        if values:
            where = self.graph.inserting_after(max(values, key=lambda v: self.position[v]))
        else:
            where = self.graph.inserting_before(user)
        with where:
            if train is False and eval_ is True:
                node = self.graph.call_function(operator.not_, (flag,))
            else:
                node = self.graph.call_function(train_or_eval, (flag, train, eval_))
                if isinstance(train, fx.Node) and "val" in train.meta:
                    node.meta["val"] = train.meta["val"]
        node.meta[PATH_KEY] = owner.meta.get(PATH_KEY, "") if owner.op != "output" else ""
        if owner.op != "output" and "nn_module_stack" in owner.meta:
            node.meta["nn_module_stack"] = dict(owner.meta["nn_module_stack"])
        return node

    def rewrite(self) -> MergeSummary:
        for n in (
            self.t_nodes
        ):  # sizes read in train mode only are read in both: they cost nothing and tie no region
            if (
                n not in self.common
                and _metadata(n)
                and all(
                    a.op in ("placeholder", "get_attr") or a in self.common
                    for a in n.all_input_nodes
                )
            ):
                self.common.add(n)
        self.train_only = {n for n in self.t_nodes if n not in self.common}
        self.position = {n: i for i, n in enumerate(self.graph.nodes)}
        for t, diffs in self.fixups:
            for d in diffs:
                _set_argument(t, d.loc, d.path, self._mode_value(d.train, d.eval, t))
                self.switched += 1
        out = next(n for n in self.graph.nodes if n.op == "output")
        e_out = next(n for n in self.eval_gm.graph.nodes if n.op == "output")
        out.args = (
            self._outputs(out.args[0], fx.node.map_arg(e_out.args[0], lambda a: self.m[a]), out),
        )
        for n in self.train_only:
            n.meta[GUARD_KEY] = True
        self.graph.lint()
        self.gm.recompile()
        return MergeSummary(
            train_only=len(self.train_only), eval_only=len(self.eval_only), switched=self.switched
        )

    def _outputs(self, train: Any, eval_: Any, out: fx.Node) -> Any:
        """The returned structure, switched where the modes return different values."""
        if isinstance(train, (list, tuple)) and isinstance(eval_, (list, tuple)):
            if len(train) != len(eval_):
                raise TraceError(
                    f"the model returns {len(train)} values in train mode but {len(eval_)} in eval "
                    "mode; fxpipe needs the same output structure in both modes"
                )
            return type(train)(self._outputs(a, b, out) for a, b in zip(train, eval_))
        if train is eval_ or (not isinstance(train, fx.Node) and _literal_equal(train, eval_)):
            return train
        self.switched += 1
        return self._mode_value(train, eval_, out)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _same_attr(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            not isinstance(a, torch.nn.Parameter)
            and not isinstance(b, torch.nn.Parameter)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and not a.is_meta
            and bool(torch.equal(a, b))
        )  # meta tensors: no values to compare
    if isinstance(a, fx.GraphModule) and isinstance(b, fx.GraphModule):
        return a.code == b.code
    return False


def merge_modes(train: fx.GraphModule, eval_: fx.GraphModule) -> MergeSummary:
    """Merge the normalized ``eval_`` graph into the normalized ``train`` graph, in place (Note [aligning two
    traces]); return how the modes differ. The result reads ``self.training`` only where they differ."""
    merger = _Merger(train, eval_)
    merger.walk()
    return merger.rewrite()
