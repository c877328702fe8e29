"""Manual stage placement: ``with fxpipe.partition(i): ...`` inside a model's ``__init__``.

Modules *constructed* inside the block are pinned to stage ``i``; nested blocks win
(innermost is on top of the stack). Pins live in a ``WeakKeyDictionary`` keyed by the
module object, so they follow the module wherever it is attached and vanish with it.
Construction is observed only while a block is open (Note [observing construction] in
:mod:`fxpipe.tracer.construct.construction`): outside, ``nn.Module`` is untouched.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch.nn as nn

from fxpipe.errors import PinError
from fxpipe.tracer.construct.construction import observe_construction

__all__ = ["partition", "pin_of", "module_pins", "pin_for_path"]

_PINS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_pin_stack: list[int] = []


def _pin_new_module(module: nn.Module, _: Any) -> None:
    if _pin_stack:
        _PINS[module] = _pin_stack[-1]


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Pin every module constructed inside the block to pipeline stage ``index``.

    Example::

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                with fxpipe.partition(0):
                    self.embed = nn.Embedding(100, 32)
                with fxpipe.partition(1):
                    self.head = nn.Linear(32, 100)
    """
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise PinError(
            f"fxpipe.partition({index!r}): the stage index must be an int >= 0, e.g. partition(0)"
        )
    _pin_stack.append(index)
    try:
        with observe_construction(_pin_new_module):
            yield
    finally:
        _pin_stack.pop()


def pin_of(module: nn.Module) -> int | None:
    """The stage a module was pinned to by :func:`partition`, or ``None``."""
    return _PINS.get(module)


def module_pins(model: nn.Module) -> dict[str, int]:
    """Pins of ``model``'s submodules (and itself), keyed by module path."""
    return {path: _PINS[m] for path, m in model.named_modules(remove_duplicate=False) if m in _PINS}


def pin_for_path(pins: dict[str, int], path: str) -> int | None:
    """The pin of the deepest pinned module on ``path`` (the module itself or an ancestor)."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        prefix = ".".join(parts[:depth])
        if prefix in pins:
            return pins[prefix]
    return None
