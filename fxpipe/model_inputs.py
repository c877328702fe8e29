"""``ModelInputs``: one call's arguments, as a model file's ``example_inputs`` gives them.

The model-file contract (``fxpipe.modelfile``) and the tracer's call binding
(``fxpipe.tracer.call``, Note [the traced call]) both read a call through ``parse_model_inputs``;
it lives below both so the model-file loader needs nothing of the tracer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["ModelInputs", "parse_model_inputs", "is_literal", "show_value"]

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
            return fn(x) if isinstance(x, torch.Tensor) else x

        return ModelInputs(
            tuple(f(a) for a in self.args), {k: f(v) for k, v in self.kwargs.items()}
        )

    def describe(self) -> str:
        """``float32[2, 5], attention_mask=int64[2, 5], use_cache=False``: for messages."""

        def show(x: Any) -> str:
            return (
                f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
                if isinstance(x, torch.Tensor)
                else show_value(x)
            )

        return ", ".join(
            [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        )


def is_literal(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(is_literal(v) for v in value)
    return isinstance(value, _LITERALS)


def _check_argument(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor) or is_literal(value):
        return
    kind = "tensors inside a " if any(isinstance(v, torch.Tensor) for v in _leaves(value)) else "a "
    raise ValueError(
        f"argument {name} is {kind}{type(value).__name__}; the inputs may be tensors and plain "
        "constants (None, bool, int, float, str): pass each tensor as an argument of its own and "
        "build other objects into the model"
    )


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, Mapping):
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


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
    if not any(isinstance(x, torch.Tensor) for x in (*call.args, *call.kwargs.values())):
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
