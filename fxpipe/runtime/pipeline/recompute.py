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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = ["checkpointed"]


def _numpy_replayed() -> tuple[contextlib.AbstractContextManager[None], Any]:
    numpy = sys.modules.get("numpy")
    if numpy is None:  # nothing has imported numpy: nothing can draw from it
        return contextlib.nullcontext(), contextlib.nullcontext()
    before = numpy.random.get_state()

    @contextlib.contextmanager
    def recomputing() -> Iterator[None]:
        after = numpy.random.get_state()
        numpy.random.set_state(before)
        try:
            yield
        finally:
            numpy.random.set_state(after)

    return contextlib.nullcontext(), recomputing()


def checkpointed(module: Callable[..., Any], *args: Any) -> Any:
    """``module(*args)`` under non-reentrant activation checkpointing, torch's and numpy's random
    state replayed in the recomputation (Note [numpy under recomputation])."""
    return torch.utils.checkpoint.checkpoint(
        module, *args, use_reentrant=False, context_fn=_numpy_replayed
    )
