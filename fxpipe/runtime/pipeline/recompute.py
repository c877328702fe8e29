"""A stage's forward under activation recomputation, drawing in the recomputation what it drew before.

Note [numpy under recomputation]: ``torch.utils.checkpoint`` runs a stage's forward again in the
backward and restores torch's random state for it, so dropout keeps its masks; a stage that draws
with numpy (SpecAugment's masks, Note [masks drawn on the host]) would draw new ones, and the
gradient would be of a forward that never ran. :func:`checkpointed` gives the recomputation
numpy's state as the forward saw it (``context_fn``) and puts numpy's state back afterwards, so the
recomputation draws nothing from the sequence the job's later forwards draw from.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpointed"]


class _NumpyReplayed:
    """Each time it is entered, numpy's state as the forward saw it (``before``); on exit, the
    state as it was on entry. Entered once per recomputation: a graph kept for a second backward
    (``retain_graph``) is recomputed again, so it must be re-enterable, as torch's own
    ``nullcontext`` is (a generator-based context manager is not)."""

    def __init__(self, numpy: Any) -> None:
        self._numpy = numpy
        self._before = numpy.random.get_state()
        self._after: list[Any] = []

    def __enter__(self) -> None:
        self._after.append(self._numpy.random.get_state())
        self._numpy.random.set_state(self._before)

    def __exit__(self, *exc: object) -> None:
        self._numpy.random.set_state(self._after.pop())


def _numpy_replayed() -> tuple[contextlib.AbstractContextManager[None], Any]:
    numpy = sys.modules.get("numpy")
    if numpy is None:  # nothing has imported numpy: nothing can draw from it
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _NumpyReplayed(numpy)


def checkpointed(module: Callable[..., Any], *args: Any) -> Any:
    """``module(*args)`` under non-reentrant activation checkpointing, torch's and numpy's random
    state replayed in the recomputation (Note [numpy under recomputation])."""
    return torch.utils.checkpoint.checkpoint(
        module, *args, use_reentrant=False, context_fn=_numpy_replayed
    )
