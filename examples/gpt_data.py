"""Training batches for ``examples/gpt.py``, in a file of their own.

``fxpipe run build/gpt --data examples/gpt_data.py:train_batches`` reads them. A data file of
its own is the way to feed a build: the model file is part of the build (its hash is in the
manifest), so editing a data function inside it means partitioning again, while this file is
read by each run. Like a model file, it imports installed packages only, not a module beside
it (the ranks import only the files they were given: docs/model-file.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 64  # examples/gpt.py's VOCAB and BLOCK
BLOCK = 16


def train_batches(batch_size: int, rank_info: Any) -> Iterator[tuple[Any, Any]]:
    """Endless batches of counting sequences (each row's start and stride drawn at random), each
    token's target the next one. Seeded from the replica, so every rank of a replica yields the
    same batches and each replica its own."""
    g = torch.Generator().manual_seed(1234 + rank_info.replica)
    positions = torch.arange(BLOCK + 1)
    while True:
        start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (batch_size, 1), generator=g)
        tokens = (start + stride * positions) % VOCAB
        yield (tokens[:, :-1],), tokens[:, 1:]
