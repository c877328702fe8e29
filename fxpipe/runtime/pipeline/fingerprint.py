"""Exact fingerprints of a batch's tensors, to check that the ranks of a pipeline hold one batch.

Note [batch fingerprint]: a rank's tensors are read as the integers their bytes spell, in rows
along dim 0 (32-bit words where a row's bytes allow, else 16-bit, else bytes). The row sums and the
column sums, in words of that width (integer sums wrap around: exact in any order, on any device,
so no false alarm between ranks whose reductions run in another order, and no wider copy of the
batch), are each folded with their index as weight modulo the prime 2**31 - 1. Equal bytes give
equal fingerprints; the ways a loader goes wrong (rows shuffled, other rows, rows shifted, other
values) change them but with odds of about 2**-31 per fold. Cost: two reductions over the batch's
bytes on the device that holds it (about 13 ms for a 38 MB batch on one loaded CPU core, 0.1 ms
for 200 kB); the ranks then exchange a few int64s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["PRIME", "tensor_fingerprint", "fingerprint"]

PRIME = 2**31 - 1


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers, one row per index of dim 0."""
    data = t.detach().contiguous().view(-1).view(torch.uint8)
    rows = t.shape[0] if t.dim() > 0 else 1
    width = data.numel() // rows
    word = torch.int32 if width % 4 == 0 else torch.int16 if width % 2 == 0 else torch.uint8
    try:
        words = data.view(word)
    except RuntimeError:  # a view whose first byte is not aligned for the word: copy it
        words = data.clone().view(word)
    return words.view(rows, -1)


def _fold(sums: torch.Tensor) -> torch.Tensor:
    sums = sums.to(torch.int64)
    weights = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device) % PRIME
    return ((sums % PRIME) * weights % PRIME).sum() % PRIME


def _folds(t: torch.Tensor) -> torch.Tensor:
    """(rows, columns) folds of ``t``'s bytes, as two int64 on ``t``'s device."""
    if t.layout != torch.strided or t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    words = _words(t)
    return torch.stack(
        [_fold(words.sum(1, dtype=words.dtype)), _fold(words.sum(0, dtype=words.dtype))]
    )


def tensor_fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """(rows, columns) folds of ``t``'s bytes (Note [batch fingerprint]); equal bytes, equal folds."""
    a, b = _folds(t).tolist()
    return a, b


def fingerprint(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """The folds of several tensors, in order, combined into two (each tensor weighted by its place);
    one synchronisation per device that holds some of them."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for k, t in enumerate(tensors, start=1):
        by_device.setdefault(t.device, []).append((k, _folds(t)))
    a = b = 0
    for device, items in by_device.items():
        places = torch.tensor([k for k, _ in items], dtype=torch.int64, device=device)
        folds = torch.stack([f for _, f in items])
        da, db = ((folds * places[:, None]) % PRIME).sum(0).tolist()
        a, b = (a + da) % PRIME, (b + db) % PRIME
    return a, b
