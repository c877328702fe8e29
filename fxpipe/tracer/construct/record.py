"""Build a model while recording what its constructors got, for stage files to reuse.

A stage file that keeps a user-defined leaf module (one the tracer could not look
into) has to construct it again, so it needs the ``(args, kwargs)`` its ``__init__``
received. :func:`build_model_recorded` watches every ``nn.Module`` constructed while the
factory runs (Note [observing construction] in :mod:`fxpipe.tracer.construct.construction`) and
maps the objects to their paths in the finished model.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch.nn as nn

from fxpipe.tracer.construct.construction import CtorArgs, observe_construction
from fxpipe.tracer.construct.pins import module_pins

__all__ = ["BuildRecord", "build_model_recorded", "record_constructors"]


@dataclass(frozen=True)
class BuildRecord:
    """What happened while a model was built.

    ``ctor_args``: module path -> ``(args, kwargs)`` of its constructor call.
    ``pins``: module path -> stage index from :func:`fxpipe.partition`.
    """

    ctor_args: dict[str, CtorArgs] = field(default_factory=dict)
    pins: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def record_constructors(into: weakref.WeakKeyDictionary[nn.Module, CtorArgs]) -> Iterator[None]:
    """Put ``module -> (args, kwargs)`` into ``into`` for every module constructed inside the block."""

    def remember(module: nn.Module, ctor: CtorArgs | None) -> None:
        if ctor is not None:
            into[module] = ctor

    with observe_construction(remember, arguments=True):
        yield


def build_model_recorded(factory: Callable[[], nn.Module]) -> tuple[nn.Module, BuildRecord]:
    """Call ``factory()`` and return the model with its :class:`BuildRecord`.

    Example::

        model, record = build_model_recorded(lambda: GPT(layers=4))
        record.ctor_args["blocks.0.attn"]  # ((32, 4, 16), {})
    """
    seen: weakref.WeakKeyDictionary[nn.Module, CtorArgs] = weakref.WeakKeyDictionary()
    with record_constructors(seen):
        model = factory()
    ctor_args = {
        path: seen[m] for path, m in model.named_modules(remove_duplicate=False) if m in seen
    }
    return model, BuildRecord(ctor_args=ctor_args, pins=module_pins(model))
