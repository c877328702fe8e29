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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fxpipe.errors import CallError
from fxpipe.model_inputs import ModelInputs, is_literal, parse_model_inputs, show_value

__all__ = [
    "ModelInputs",
    "parse_model_inputs",
    "Constant",
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
class CallSpec:
    """How a build is called (Note [the traced call]): ``parameters`` are the forward's
    parameters in order (positional arguments bind to them), ``inputs`` the parameter of each
    tensor input in the build's input order, ``constants`` every other parameter."""

    parameters: tuple[str, ...]
    inputs: tuple[str, ...]
    constants: tuple[Constant, ...] = ()

    def __post_init__(self) -> None:
        for name in ("parameters", "inputs", "constants"):
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
        """``bind`` for a ``ModelInputs``, a dict of keyword arguments, a tensor or a sequence of positional ones."""
        if isinstance(inputs, ModelInputs):
            return self.bind(inputs.args, inputs.kwargs)
        if isinstance(inputs, Mapping):
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

        def shape(x: Any) -> Any:
            return dim_of[id(x)] or None if isinstance(x, torch.Tensor) else None

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
    parameters, inputs, tensors = [], [], []
    constants: list[Constant] = []
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
    spec = CallSpec(tuple(parameters), tuple(inputs), tuple(constants))
    return BoundCall(spec, tuple(tensors), concrete, symbolic, example, sig)


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
