"""Runs from one random state: torch's, numpy's and Python's global generators, restored afterwards.

Note [one random state for both sides]: fxpipe compares two runs that must draw alike -- the
model against its trace, the model against its stages in the build's check, train mode against
eval mode -- and a model draws from more than torch: Wav2Vec2's SpecAugment masks come from
numpy's global state (Note [masks drawn on the host]). :func:`seeded` starts each run from the
same state of all three generators and leaves the caller's state as it was, so neither the
comparison nor the user's own sequence of draws depends on what fxpipe ran in between.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator, Sequence

import torch

__all__ = ["seeded"]


@contextlib.contextmanager
def seeded(
    seed: int | None, devices: Sequence[int | str | torch.device] | None = ()
) -> Iterator[None]:
    """Run the block with torch's (on the CPU and ``devices``; None: every CUDA device, as
    ``torch.random.fork_rng``), numpy's and Python's global generators seeded with ``seed`` (left
    as they are with None), and restore all three after it."""
    numpy = sys.modules.get("numpy")  # a model that draws with numpy has imported it
    saved = random.getstate(), numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=None if devices is None else list(devices)):
        try:
            if seed is not None:
                torch.manual_seed(seed)
                random.seed(seed)
                if numpy is not None:
                    numpy.random.seed(seed)
            yield
        finally:
            random.setstate(saved[0])
            if numpy is not None:
                numpy.random.set_state(saved[1])
