"""``ModelInputs``: one call's arguments, as a model file's ``example_inputs`` gives them.

The model-file contract (``fxpipe.modelfile``) and the tracer's call binding
(``fxpipe.tracer.call``, Note [the traced call]) both read a call through ``parse_model_inputs``;
it lives below both so the model-file loader needs nothing of the tracer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = [
    "ModelInputs",
    "parse_model_inputs",
    "is_literal",
    "is_tree",
    "flatten_tree",
    "show_value",
]

_LITERALS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class ModelInputs:
    """One call's arguments: ``model(*args, **kwargs)``."""

    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, fn: Callable[..., Any]) -> Any:
        """``fn(*args, **kwargs)``."""
        return fn(*self.args, **self.kwargs)

    def map_tensors(self, fn: Callable[[torch.Tensor], Any]) -> ModelInputs:
        """The same call with ``fn`` applied to every tensor argument."""

        def f(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return fn(x)
            if is_tree(x):  # Note [tensors inside containers]
                _register_dataclasses(x)
                return pytree.tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, x)
            return x

        return ModelInputs(
            tuple(f(a) for a in self.args), {k: f(v) for k, v in self.kwargs.items()}
        )

    def describe(self) -> str:
        """``float32[2, 5], attention_mask=int64[2, 5], use_cache=False``: for messages."""

        def show(x: Any) -> str:
            if isinstance(x, torch.Tensor):
                return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
            if is_tree(x):
                leaves = ", ".join(f"{path}: {show(v)}" for path, v in flatten_tree(x)[0])
                return f"{type(x).__name__}({leaves})"
            return show_value(x)

        return ", ".join(
            [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        )


def is_literal(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(is_literal(v) for v in value)
    return isinstance(value, _LITERALS)


# Note [tensors inside containers]: an argument may be a pytree of tensors and plain constants
# (dicts, lists, tuples, dataclasses, transformers ``ModelOutput``s: whatever
# ``torch.utils._pytree`` flattens, as ``torch.export`` takes them). At the model's boundary
# it is flattened: each tensor leaf is a tensor input of its own, named after the argument and
# its place in it (``batch['image']`` -> ``batch_image``), and the structure with its constant
# leaves is recorded (``fxpipe.tracer.call.TreeArgument``), so a later call with the same
# structure binds to the build's flat inputs and one with another structure is refused. A
# dataclass pytree does not know yet is registered with it on first sight (its fields, in
# order), in every process that flattens one.


def _register_dataclasses(value: Any) -> None:
    """Register with pytree every dataclass type inside ``value`` that it does not know yet."""
    for _ in range(100):  # one level of nesting per round
        found = False
        for leaf in pytree.tree_leaves(value):
            cls = type(leaf)
            if dataclasses.is_dataclass(leaf) and cls not in pytree.SUPPORTED_NODES:
                pytree.register_dataclass(
                    cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}"
                )
                found = True
        if not found:
            return


def is_tree(value: Any) -> bool:
    """Whether ``value`` is a container (not a tensor, not a plain constant) holding a tensor."""
    if isinstance(value, torch.Tensor) or is_literal(value):
        return False
    if not (
        isinstance(value, (tuple, list, Mapping))
        or dataclasses.is_dataclass(value)
        or type(value) in pytree.SUPPORTED_NODES
    ):
        return False
    _register_dataclasses(value)
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


def flatten_tree(value: Any) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """``([(path, leaf), ...], spec)``: ``value``'s leaves with their paths (``['image']``,
    ``[0]``, ``.pixels``) in pytree's order, which is ``torch.export``'s (Note [tensors inside
    containers])."""
    _register_dataclasses(value)
    leaves, spec = pytree.tree_flatten_with_path(value)
    return [(pytree.keystr(path), leaf) for path, leaf in leaves], spec


def _check_argument(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) or is_literal(value):
        return
    if is_tree(value):
        for path, leaf in flatten_tree(value)[0]:
            if not (isinstance(leaf, torch.Tensor) or is_literal(leaf)):
                raise ValueError(
                    f"argument {name}{path} is a {type(leaf).__name__}; the inputs may hold "
                    "tensors and plain constants (None, bool, int, float, str) in dicts, lists, "
                    "tuples and dataclasses: build other objects into the model"
                )
        return
    raise ValueError(
        f"argument {name} is a {type(value).__name__}; the inputs may be tensors and plain "
        "constants (None, bool, int, float, str), or dicts, lists, tuples and dataclasses of "
        "them: build other objects into the model"
    )


def parse_model_inputs(value: Any) -> ModelInputs:
    """The model-file contract's example inputs as a ``ModelInputs``.

    Accepted: a tensor, a tuple or list (positional arguments), a dict (keyword
    arguments), an ``(args, kwargs)`` pair (a tuple/list and a dict) or a ``ModelInputs``.
    Raises ``ValueError`` (the caller names the function) for anything else, and for
    arguments that are neither tensors nor plain constants.
    """
    if isinstance(value, ModelInputs):
        call = value
    elif isinstance(value, torch.Tensor):
        call = ModelInputs((value,))
    elif isinstance(value, Mapping):
        call = ModelInputs((), dict(value))
    elif (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and isinstance(value[0], (tuple, list))
        and isinstance(value[1], Mapping)
    ):
        call = ModelInputs(tuple(value[0]), dict(value[1]))
    elif isinstance(value, (tuple, list)):
        call = ModelInputs(tuple(value))
    else:
        raise ValueError(
            f"got {type(value).__name__} {value!r:.40}; return a tuple of positional arguments, a dict of keyword "
            "arguments or an (args, kwargs) pair"
        )
    for key in call.kwargs:
        if not isinstance(key, str):
            raise ValueError(f"keyword argument names must be strings, got {key!r}")
    for i, a in enumerate(call.args):
        _check_argument(f"{i}", a)
    for k, v in call.kwargs.items():
        _check_argument(repr(k), v)
    if not any(
        isinstance(x, torch.Tensor) or is_tree(x) for x in (*call.args, *call.kwargs.values())
    ):
        raise ValueError(
            f"no argument is a tensor ({call.describe() or 'no arguments'}); pass the model's tensor "
            "inputs"
        )
    return call


def show_value(value: Any) -> str:
    """A value in a message: a tensor by its dtype and shape, anything else by its (shortened) repr."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')}{list(value.shape)} tensor"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
