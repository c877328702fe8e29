"""The model's call: example arguments (positional, keyword or both) and how a build binds a later call.

Note [the traced call]: a model is traced on one call, ``model(*args, **kwargs)``
(``ModelInputs``). Bound to the forward signature (``bind_example``), its arguments
split into

* tensor inputs, the graph's placeholders, in the order of the forward's parameters and
  named after them (``CallSpec.inputs``);
* constants: every other parameter, given (``None``, a flag, a number) or left at its
  default. The trace specializes them (``if attention_mask is None`` took one branch, an
  unused default vanished), so they are recorded (``CallSpec.constants``) and a later call
  that gives another value is refused with a ``CallError`` instead of silently computing
  the traced branch.

A build's ``CallSpec`` turns any later call -- positional, keyword or both -- into its
tensor inputs the way Python binds arguments to the original forward (``CallSpec.bind``).
The front ends read the call being traced from ``active_call()``, set by ``trace_model``
around the front end (``tracing_call``): the front-end choice passes them only the tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.errors import CallError
from fxpipe.model_inputs import (
    ModelInputs,
    flatten_tree,
    is_literal,
    is_tree,
    parse_model_inputs,
    show_value,
)

__all__ = [
    "ModelInputs",
    "parse_model_inputs",
    "Constant",
    "TreeArgument",
    "CallSpec",
    "BoundCall",
    "bind_example",
    "tracing_call",
    "active_call",
]


def _plain(value: Any) -> Any:
    """A constant in the form a manifest keeps it: lists and tuples as tuples (hashable, and a JSON
    list read back compares equal)."""
    return tuple(_plain(v) for v in value) if isinstance(value, (tuple, list)) else value


@dataclass(frozen=True)
class Constant:
    """A forward argument the trace fixed: ``value`` as JSON when ``literal`` (None, bool, int,
    float, str, lists of them), else the ``repr`` of an object default. ``default``: the value is
    the forward's own default, so a call may leave the argument out."""

    name: str
    value: Any = None
    literal: bool = True
    default: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _plain(self.value))
        if self.literal and not is_literal(self.value):
            raise ValueError(f"constant {self.name!r}: {self.value!r} is not a plain constant")

    @staticmethod
    def of(name: str, value: Any, default: bool) -> Constant:
        if is_literal(value):
            return Constant(name, value, True, default)
        return Constant(name, repr(value), False, default)

    def matches(self, value: Any) -> bool:
        if not self.literal:
            return repr(value) == self.value
        return (
            is_literal(value)
            and _plain(value) == self.value
            and _same_types(_plain(value), self.value)
        )

    def shown(self) -> str:
        return repr(self.value) if self.literal else self.value


def _same_types(a: Any, b: Any) -> bool:
    """``True == 1`` in Python, but a flag and a number are different constants."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return all(_same_types(x, y) for x, y in zip(a, b))
    return isinstance(a, bool) == isinstance(b, bool)


@dataclass(frozen=True)
class TreeArgument:
    """A forward argument that is a container of tensors (Note [tensors inside containers] in
    ``fxpipe.model_inputs``): ``paths`` are its leaves' places in it (``['image']``, ``[0]``,
    ``.pixels``) in pytree's order; ``inputs`` the tensor input each leaf is (``None``: a constant
    leaf, whose value is in ``values``); ``spec`` its pytree structure as JSON
    (``treespec_dumps``; ``None`` where pytree cannot write it), to rebuild a call from the build's
    tensor inputs."""

    name: str
    paths: tuple[str, ...]
    inputs: tuple[str | None, ...]
    values: tuple[Any, ...]
    spec: str | None = None

    def __post_init__(self) -> None:
        for name in ("paths", "inputs", "values"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "values", tuple(_plain(v) for v in self.values))

    def flatten(self, value: Any) -> dict[str, torch.Tensor]:
        """The tensor inputs of ``value`` by input name; ``CallError`` when ``value`` has another
        structure or another constant leaf than the traced one."""
        leaves = flatten_tree(value)[0] if is_tree(value) else None
        paths = tuple(path for path, _ in leaves or ())
        if leaves is None or paths != self.paths:
            raise CallError(
                f"{self.name} holds {', '.join(self.name + p for p in self.paths)} in the traced "
                f"call, but this call passes {show_value(value) if leaves is None else ', '.join(self.name + p for p in paths)}; "
                "pass the same structure (only the tensors may change)"
            )
        tensors = {}
        for (path, leaf), name, traced in zip(leaves, self.inputs, self.values):
            if name is not None:
                if not isinstance(leaf, torch.Tensor):
                    raise CallError(
                        f"{self.name}{path} was a tensor when the model was traced, but this call "
                        f"passes {show_value(leaf)}"
                    )
                tensors[name] = leaf
            elif not Constant(self.name + path, traced).matches(leaf):
                raise CallError(
                    f"{self.name}{path}={show_value(leaf)} differs from the value the model was "
                    f"traced with ({traced!r}): the build computes the traced case only"
                )
        return tensors

    def rebuild(self, tensors: Mapping[str, torch.Tensor]) -> Any:
        """The argument with ``tensors`` (by input name) at the tensor leaves."""
        if self.spec is None:
            raise CallError(
                f"the structure of {self.name} cannot be rebuilt from the manifest; pass the call "
                "yourself"
            )
        leaves = [
            tensors[name] if name is not None else value
            for name, value in zip(self.inputs, self.values)
        ]
        return pytree.tree_unflatten(leaves, pytree.treespec_loads(self.spec))


@dataclass(frozen=True)
class CallSpec:
    """How a build is called (Note [the traced call]): ``parameters`` are the forward's
    parameters in order (positional arguments bind to them), ``inputs`` the parameter of each
    tensor input in the build's input order, ``constants`` every other parameter, ``trees`` the
    parameters that are containers of tensors, whose leaves are tensor inputs (Note [tensors
    inside containers] in ``fxpipe.model_inputs``)."""

    parameters: tuple[str, ...]
    inputs: tuple[str, ...]
    constants: tuple[Constant, ...] = ()
    trees: tuple[TreeArgument, ...] = ()

    def __post_init__(self) -> None:
        for name in ("parameters", "inputs", "constants", "trees"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @staticmethod
    def positional(names: Sequence[str]) -> CallSpec:
        """A build called with its tensor inputs only, in order (a build made without a traced call)."""
        return CallSpec(tuple(names), tuple(names))

    def signature(self) -> str:
        """``(input_ids, attention_mask, labels)``: the tensor inputs, for messages."""
        return f"({', '.join(self.inputs)})"

    def bind(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The tensor inputs of the call ``(*args, **kwargs)``, in the build's order.

        Raises ``CallError`` when an argument is missing, unknown, given twice, or a
        constant of the trace with another value.
        """
        kwargs = kwargs or {}
        if len(args) > len(self.parameters):
            raise CallError(
                f"the model takes {len(self.parameters)} positional arguments "
                f"({', '.join(self.parameters)}) but {len(args)} were given"
            )
        given: dict[str, Any] = dict(zip(self.parameters, args))
        for key, value in kwargs.items():
            if key in given:
                raise CallError(f"the model got multiple values for argument {key!r}")
            given[key] = value
        for tree in self.trees:
            if tree.name not in given:
                raise CallError(
                    f"the model was traced with tensors inside {tree.name!r}, but this call does "
                    f"not pass it; the build's tensor inputs are {self.signature()}"
                )
            given.update(tree.flatten(given.pop(tree.name)))
        for c in self.constants:
            if c.name in given:
                value = given.pop(c.name)
                if not c.matches(value):
                    raise CallError(
                        f"{c.name}={show_value(value)} differs from the value the model was traced with "
                        f"({c.name}={c.shown()}): the build computes the traced case only; pass "
                        f"{c.name}={c.shown()} or partition again with example inputs that pass "
                        f"{c.name}={show_value(value)}"
                    )
            elif not c.default:
                raise CallError(
                    f"the model was traced with {c.name}={c.shown()}, but this call leaves {c.name!r} "
                    f"out (its default may differ); pass {c.name}={c.shown()}"
                )
        tensors = []
        for name in self.inputs:
            if name not in given:
                raise CallError(
                    f"the model was traced with a tensor for {name!r}, but this call does not pass it; "
                    f"the build's tensor inputs are {self.signature()}"
                )
            value = given.pop(name)
            if not isinstance(value, torch.Tensor):
                raise CallError(
                    f"{name!r} was a tensor when the model was traced, but this call passes "
                    f"{show_value(value)}; the build's tensor inputs are {self.signature()}"
                )
            tensors.append(value)
        if given:
            raise CallError(
                f"the model was traced without the arguments {sorted(given)}, so the build cannot take "
                f"them; its tensor inputs are {self.signature()}: partition again with example inputs "
                "that pass them"
            )
        return tuple(tensors)

    def call_of(self, tensors: Sequence[torch.Tensor]) -> ModelInputs:
        """A call that ``bind`` maps to ``tensors``: keyword arguments, and every constant that is not a default."""
        if len(tensors) != len(self.inputs):
            raise CallError(
                f"got {len(tensors)} tensors for the build's {len(self.inputs)} inputs {self.signature()}"
            )
        kwargs: dict[str, Any] = dict(zip(self.inputs, tensors))
        for tree in self.trees:
            kwargs[tree.name] = tree.rebuild(kwargs)
            for name in tree.inputs:
                if name is not None:
                    del kwargs[name]
        for c in self.constants:
            if not c.default:
                if not c.literal:
                    raise CallError(
                        f"{c.name} was traced with the object {c.value}, which a call cannot be rebuilt "
                        "with; pass the call yourself"
                    )
                kwargs[c.name] = c.value
        return ModelInputs((), kwargs)

    def bind_any(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """``bind`` for a ``ModelInputs``, a dict of keyword arguments, a tensor or a sequence of positional ones.

        A dict whose keys are not all parameters of ``forward`` is the first argument when the
        build takes containers (Note [tensors inside containers] in ``fxpipe.model_inputs``):
        ``runner.step(batch)`` for ``model(batch)``."""
        if isinstance(inputs, ModelInputs):
            return self.bind(inputs.args, inputs.kwargs)
        if isinstance(inputs, Mapping):
            if self.trees and self.parameters and not set(inputs) <= set(self.parameters):
                # a dict that is not keyword arguments: the model's first argument (a batch dict)
                return self.bind((inputs,))
            return self.bind((), inputs)
        if isinstance(inputs, torch.Tensor):
            return self.bind((inputs,))
        return self.bind(tuple(inputs))


@dataclass(frozen=True)
class BoundCall:
    """The example call bound to the forward signature (Note [the traced call]).

    ``tensors`` are the tensor inputs in ``spec.inputs`` order; ``concrete`` every named
    parameter that is not a tensor input, with its value (FX's ``concrete_args``);
    ``symbolic`` whether FX can trace the call (nothing passed through ``*args`` / ``**kwargs``,
    which FX can neither make inputs nor constants).
    """

    spec: CallSpec
    tensors: tuple[torch.Tensor, ...]
    concrete: Mapping[str, Any]
    symbolic: bool
    example: ModelInputs
    signature: inspect.Signature

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> BoundCall:
        """The same call with other tensors (moved, or a doubled batch) in the same places."""
        assert len(tensors) == len(self.tensors), "one tensor per tensor input"
        new = {id(old): t for old, t in zip(self.tensors, tensors)}
        example = self.example.map_tensors(lambda old: new[id(old)])
        return BoundCall(
            self.spec, tuple(tensors), self.concrete, self.symbolic, example, self.signature
        )

    def export_arguments(
        self, shapes: Sequence[dict[int, Any] | None]
    ) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any], dict[str, Any]]:
        """``(args, kwargs, dynamic_shapes, bound)`` for ``torch.export``: ``shapes[i]`` maps the dynamic
        dimensions of tensor input ``i`` to their ``torch.export.Dim``. ``bound`` are the constants given
        through ``**kwargs``, which the caller binds to ``forward`` (``functools.partial``): torch 2.13's
        export cannot combine dynamic shapes with arguments in ``**kwargs``. Raises ``ValueError``
        for a tensor in ``**kwargs``, for the same reason."""
        dim_of = dict(zip((id(t) for t in self.tensors), shapes))

        def leaf_shape(x: Any) -> Any:
            return dim_of[id(x)] or None if isinstance(x, torch.Tensor) else None

        def shape(x: Any) -> Any:  # a container's leaves each (Note [tensors inside containers])
            return _container_shapes(x, leaf_shape) if is_tree(x) else leaf_shape(x)

        bound = self.signature.bind(*self.example.args, **self.example.kwargs)
        dynamic: dict[str, Any] = {}
        kwargs = dict(bound.kwargs)
        extra: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                dynamic[name] = tuple(shape(v) for v in value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                tensors = [k for k, v in value.items() if isinstance(v, torch.Tensor)]
                if tensors:
                    raise ValueError(
                        f"torch.export cannot give tensors passed through **{name} ({', '.join(tensors)}) "
                        "a dynamic batch; pass them through named parameters of forward()"
                    )
                extra = dict(value)
                for key in extra:
                    kwargs.pop(key)
            else:
                dynamic[name] = shape(value)
        return tuple(bound.args), kwargs, dynamic, extra


def _container_shapes(value: Any, leaf: Any) -> Any:
    """``torch.export``'s ``dynamic_shapes`` for a container: dicts, lists and tuples as themselves,
    any other pytree node (a dataclass, a ``ModelOutput``) as the list of its children."""
    if isinstance(value, torch.Tensor) or pytree.tree_is_leaf(value):
        return leaf(value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _container_shapes(v, leaf) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_container_shapes(v, leaf) for v in value)
    children, _ = pytree.SUPPORTED_NODES[type(value)].flatten_fn(value)
    return [_container_shapes(v, leaf) for v in children]


def bind_example(model: nn.Module, example: ModelInputs) -> BoundCall:
    """Bind ``example`` to ``model.forward`` (Note [the traced call]).

    Raises ``ValueError`` when the arguments do not fit the signature (missing, unknown or
    given twice).
    """
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*example.args, **example.kwargs)
    except TypeError as exc:
        raise ValueError(f"they do not fit {type(model).__name__}.forward{sig}: {exc}") from None
    parameters: list[str] = []
    inputs: list[str] = []
    tensors: list[torch.Tensor] = []
    constants: list[Constant] = []
    trees: list[TreeArgument] = []
    concrete: dict[str, Any] = {}
    symbolic = True
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            extra = {f"{name}_{i}": v for i, v in enumerate(bound.arguments.get(name, ()))}
            parameters += list(extra)
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            extra = dict(bound.arguments.get(name, {}))
        else:
            if p.kind is not inspect.Parameter.KEYWORD_ONLY:
                parameters.append(name)
            value = bound.arguments.get(name, p.default)
            if is_tree(value):
                tree = _tree_argument(name, value, taken=set(sig.parameters) | set(inputs))
                trees.append(tree)
                inputs += [n for n in tree.inputs if n is not None]
                tensors += [
                    leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)
                ]
                symbolic = False  # FX takes no containers as inputs; torch.export does
                continue
            if not isinstance(value, torch.Tensor):
                concrete[name] = value
                constants.append(Constant.of(name, value, default=_is_default(p, value)))
                continue
            extra = {name: value}
        for key, value in extra.items():
            if isinstance(value, torch.Tensor):
                inputs.append(key)
                tensors.append(value)
            else:
                constants.append(Constant.of(key, value, default=False))
        symbolic = symbolic and not (extra and p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    spec = CallSpec(tuple(parameters), tuple(inputs), tuple(constants), tuple(trees))
    return BoundCall(spec, tuple(tensors), concrete, symbolic, example, sig)


def _tree_argument(name: str, value: Any, taken: set[str]) -> TreeArgument:
    """``value`` (a container of tensors) as the argument ``name`` of the build: each tensor leaf
    a tensor input named after its place (``batch['image']`` -> ``batch_image``), unique among
    ``taken`` (Note [tensors inside containers] in ``fxpipe.model_inputs``)."""
    leaves, spec = flatten_tree(value)
    paths: list[str] = []
    inputs: list[str | None] = []
    values: list[Any] = []
    for path, leaf in leaves:
        paths.append(path)
        if isinstance(leaf, torch.Tensor):
            base = name + "_" + re.sub(r"\W+", "_", path).strip("_")
            input_name, i = base, 1
            while input_name in taken:
                input_name, i = f"{base}_{i}", i + 1
            taken.add(input_name)
            inputs.append(input_name)
            values.append(None)
        else:
            inputs.append(None)
            values.append(leaf)
    try:
        text: str | None = pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - a container pytree cannot write: the call is not rebuilt
        text = None
    return TreeArgument(name, tuple(paths), tuple(inputs), tuple(values), text)


def _is_default(p: inspect.Parameter, value: Any) -> bool:
    """Whether ``value`` is ``p``'s default (so leaving the argument out is the same call)."""
    if p.default is p.empty:
        return False
    return value is p.default or Constant.of(p.name, p.default, True).matches(value)


_ACTIVE: contextvars.ContextVar[BoundCall | None] = contextvars.ContextVar(
    "fxpipe_traced_call", default=None
)


@contextlib.contextmanager
def tracing_call(call: BoundCall) -> Iterator[None]:
    """Make ``call`` the call the front ends trace (``active_call``) inside the block."""
    token = _ACTIVE.set(call)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_call(n_inputs: int) -> BoundCall | None:
    """The call being traced, when it has ``n_inputs`` tensor inputs; ``None`` outside
    ``tracing_call`` (a front end called directly traces its inputs as positional arguments)."""
    call = _ACTIVE.get()
    return call if call is not None and len(call.tensors) == n_inputs else None
