"""Reading JSON into frozen dataclasses, each value checked against the field's type hint.

Every artifact (profile, plan, manifest) is read through ``read_dataclass``, so a file
with a wrong type, a missing field, ``NaN``/``Infinity`` or a negative size fails with one
line that names the field, e.g. ``profile units[3].fwd_ms: expected a number, got 'fast'``,
and never with a traceback from deep inside a constructor.

The checks come from the type hints: ``int``, ``float`` (finite), ``bool``, ``str``,
``X | None``, ``tuple[X, ...]``, ``dict[str, X]``, nested dataclasses, and lower bounds
written as ``Annotated[int, AtLeast(0)]`` (the aliases ``NonNegInt``, ``PositiveInt`` and
``NonNegFloat``). Keys a dataclass does not know are ignored (a profile written by another
tool may carry more), and a missing key takes the field's default.

>>> from dataclasses import dataclass
>>> from fxpipe.errors import ProfileError
>>> @dataclass(frozen=True)
... class Point:
...     x: NonNegFloat
...     label: str = ""
>>> read_dataclass(Point, {"x": 1}, "point", ProfileError)
Point(x=1.0, label='')
>>> read_dataclass(Point, {"x": -1}, "point", ProfileError)
Traceback (most recent call last):
fxpipe.errors.ProfileError: point x: expected a number >= 0, got -1
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fxpipe.errors import FxpipeError

__all__ = [
    "AtLeast",
    "NonNegInt",
    "PositiveInt",
    "NonNegFloat",
    "read_dataclass",
    "find_non_finite",
]

T = TypeVar("T")


@dataclass(frozen=True)
class AtLeast:
    """``Annotated`` metadata: the number must be ``>= minimum``."""

    minimum: float


NonNegInt = Annotated[int, AtLeast(0)]
PositiveInt = Annotated[int, AtLeast(1)]
NonNegFloat = Annotated[float, AtLeast(0)]

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


class _Bad(Exception):
    """A value that does not fit its hint; ``path`` grows as it unwinds to the artifact root."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message, self.path = message, path


def read_dataclass(cls: type[T], data: Any, what: str, error: type[FxpipeError]) -> T:
    """``cls`` built from the JSON value ``data``, or ``error("<what> <field path>: <problem>")``.

    ``FxpipeError``s raised by the dataclasses' own ``__post_init__`` checks (e.g. an edge
    that goes backwards) come out as ``error`` too, prefixed with the path of the object.
    """
    try:
        return typing.cast(T, _read(cls, data))
    except _Bad as bad:
        where = f"{what} {bad.path.lstrip('.')}" if bad.path else what
        raise error(f"{where}: {bad.message}") from None


def find_non_finite(data: Any, path: str = "") -> str | None:
    """The path of the first ``NaN`` or infinite float in nested dicts and lists, else ``None``."""
    if isinstance(data, float) and not math.isfinite(data):
        return path.lstrip(".") or "(the value itself)"
    if isinstance(data, dict):
        items: Any = ((f".{k}", v) for k, v in data.items())
    elif isinstance(data, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(data))
    else:
        return None
    for key, value in items:
        found = find_non_finite(value, path + key)
        if found is not None:
            return found
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _show(value: Any) -> str:
    """A value as a JSON reader would write it in a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *meta = typing.get_args(hint)
        out = _read(base, value)
        for m in meta:
            if isinstance(m, AtLeast) and out < m.minimum:
                raise _Bad(
                    f"expected {_NAMES.get(base, 'a number')} >= {m.minimum:g}, got {_show(value)}"
                )
        return out
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _read(rest[0], value)
        raise AssertionError(f"schema: unions other than X | None are not supported: {hint}")
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _read_dataclass(hint, value)
    if origin is tuple:
        return _read_tuple(typing.get_args(hint), value)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise _Bad(f"expected an object, got {_show(value)}")
        out = {}
        for k, v in value.items():
            try:
                out[_read(key_hint, k)] = _read(value_hint, v)
            except _Bad as bad:
                raise _Bad(bad.message, f"[{k!r}]{bad.path}") from None
        return out
    return _read_scalar(hint, value)


def _read_scalar(hint: Any, value: Any) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise _Bad(f"expected a finite number, got {_show(value)}")
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise AssertionError(f"schema: unsupported type hint {hint!r}")
    raise _Bad(f"expected {_NAMES[hint]}, got {_show(value)}")


def _read_tuple(args: tuple[Any, ...], value: Any) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _Bad(f"expected a list, got {_show(value)}")
    if len(args) == 2 and args[1] is Ellipsis:
        item_hints = [args[0]] * len(value)
    elif len(args) != len(value):
        raise _Bad(f"expected a list of {len(args)} items, got {len(value)}")
    else:
        item_hints = list(args)
    out = []
    for i, (h, v) in enumerate(zip(item_hints, value)):
        try:
            out.append(_read(h, v))
        except _Bad as bad:
            raise _Bad(bad.message, f"[{i}]{bad.path}") from None
    return tuple(out)


def _read_dataclass(cls: type, value: Any) -> Any:
    if not isinstance(value, dict):
        raise _Bad(f"expected an object, got {_show(value)}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Bad(f"missing the field {f.name!r}")
            continue
        try:
            kwargs[f.name] = _read(hints[f.name], value[f.name])
        except _Bad as bad:
            raise _Bad(bad.message, f".{f.name}{bad.path}") from None
    try:
        return cls(**kwargs)
    except FxpipeError as exc:  # the dataclass's own consistency checks
        raise _Bad(str(exc)) from None
