"""Observe ``nn.Module`` construction, only while a ``partition`` block or a recording is active.

Note [observing construction]: pins (``fxpipe.partition(i)``) and constructor arguments
(for leaf modules a stage file must build again) are both learnt when a module is
built. While at least one observer is active, ``nn.Module.__init__`` (a plain Python
function) is replaced by a wrapper that runs it and then tells the observers; when
the last one leaves, the original is put back, so outside these windows ``nn.Module``
is exactly as PyTorch defines it. (A ``__new__`` on ``nn.Module`` would see the
arguments directly, but CPython cannot take one off a class again: after ``del``,
subclasses called with arguments fail with "object.__new__() takes exactly one
argument".)

The wrapper runs when a module's ``__init__`` calls ``super().__init__()``. The
arguments the module was constructed with are those of the outermost ``__init__``
running on it (the most derived class's, which ``type.__call__`` called): read from
its frame, as bound when it was called, with trailing arguments that are their
defaults left out, as a caller would write them. A class without an ``__init__`` of
its own passes its arguments to ``nn.Module.__init__`` itself. An argument rebound
before ``super().__init__()`` is read as rebound; codegen rebuilds every leaf on the
meta device and compares it with the original, so a wrong capture is an error, never
a silently different model.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from types import FrameType
from typing import Any, Callable, Iterator

import torch.nn as nn

__all__ = ["CtorArgs", "Observer", "observe_construction"]

CtorArgs = tuple[tuple[Any, ...], dict[str, Any]]
Observer = Callable[[nn.Module, CtorArgs | None], None]

_lock = threading.RLock()
_observers: list[tuple[Observer, bool]] = []  # (observer, wants constructor arguments)
_installed: tuple[Any, Any] | None = None  # (original nn.Module.__init__, the wrapper in its place)


@contextlib.contextmanager
def observe_construction(observer: Observer, *, arguments: bool = False) -> Iterator[None]:
    """Call ``observer(module, ctor_args)`` for every ``nn.Module`` constructed inside the block.

    ``ctor_args`` is ``(args, kwargs)`` of the constructor call when ``arguments`` is true
    (``None`` if they cannot be read), else ``None``. ``nn.Module`` is restored when the
    last active block ends (Note [observing construction]).
    """
    entry = (observer, arguments)
    with _lock:
        if not _observers:
            _install()
        _observers.append(entry)
    try:
        yield
    finally:
        with _lock:
            _observers.remove(entry)
            if not _observers:
                _uninstall()


def _install() -> None:
    global _installed
    original = nn.Module.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _notify(self, sys._getframe(1), args, kwargs)

    nn.Module.__init__ = __init__  # type: ignore[method-assign]
    _installed = (original, __init__)


def _uninstall() -> None:
    global _installed
    if _installed is None:
        return
    original, wrapper = _installed
    if nn.Module.__dict__.get("__init__") is wrapper:  # never undo someone else's later patch
        nn.Module.__init__ = original  # type: ignore[method-assign]
    _installed = None


def _notify(
    module: nn.Module, caller: FrameType | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    observers = list(_observers)
    if not observers:
        return
    ctor: CtorArgs | None = None
    if any(wants for _, wants in observers):
        try:
            ctor = constructor_arguments(module, caller, args, kwargs)
        except (
            Exception
        ):  # never break the user's construction; codegen reports a leaf it cannot rebuild
            ctor = None
    for observer, wants in observers:
        observer(module, ctor if wants else None)


def constructor_arguments(
    module: nn.Module, caller: FrameType | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> CtorArgs | None:
    """The arguments ``module`` was constructed with, seen from ``nn.Module.__init__`` called from
    frame ``caller`` with ``args``/``kwargs`` (Note [observing construction])."""
    outer, frame = None, caller
    while frame is not None and frame.f_code.co_name == "__init__" and _self_of(frame) is module:
        outer, frame = frame, frame.f_back
    if outer is None:  # no __init__ of its own: nn.Module.__init__ got the constructor's arguments
        return tuple(args), dict(kwargs)
    return _bound_arguments(outer, type(module))


def _self_of(frame: FrameType) -> Any:
    code = frame.f_code
    return frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def _bound_arguments(frame: FrameType, cls: type) -> CtorArgs | None:
    code, values = frame.f_code, frame.f_locals
    names, n_pos, n_kw = code.co_varnames, code.co_argcount, code.co_kwonlyargcount
    try:
        positional = [values[name] for name in names[1:n_pos]]
        keywords = {name: values[name] for name in names[n_pos : n_pos + n_kw]}
        i = n_pos + n_kw
        star: tuple[Any, ...] = ()
        if code.co_flags & inspect.CO_VARARGS:
            star, i = tuple(values[names[i]]), i + 1
        star_kw = dict(values[names[i]]) if code.co_flags & inspect.CO_VARKEYWORDS else {}
    except KeyError:  # an argument deleted before super().__init__(): not recorded
        return None
    fn = _init_with_code(cls, code)
    if fn is not None:  # leave out what the caller need not write: trailing defaults
        defaults = fn.__defaults__ or ()
        first = n_pos - len(defaults)  # index in names of the first parameter with a default
        while (
            not star
            and positional
            and len(positional) >= first
            and positional[-1] is defaults[len(positional) - first]
        ):
            positional.pop()
        kw_defaults = fn.__kwdefaults__ or {}
        keywords = {
            k: v for k, v in keywords.items() if not (k in kw_defaults and v is kw_defaults[k])
        }
    return (*positional, *star), {**keywords, **star_kw}


def _init_with_code(cls: type, code: Any) -> Any:
    """The ``__init__`` function in ``cls``'s MRO whose code ``code`` is (through decorators)."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get("__init__")
        try:
            fn = inspect.unwrap(fn) if callable(fn) else None
        except ValueError:
            continue
        if getattr(fn, "__code__", None) is code:
            return fn
    return None
