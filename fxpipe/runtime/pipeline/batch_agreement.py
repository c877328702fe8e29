"""Do the ranks of one pipeline hold one batch? One small collective per step, and a line naming the tensor.

Note [one batch per pipeline]: every rank of a pipeline is given the step's batch, and each reads
its part (the first stage the inputs, the loss stage the targets). A loader that yields other rows
on another rank (a ``DataLoader(shuffle=True)`` without a seeded generator, a data function seeded
from the rank or from a global RNG that dropout advances on some ranks only) trains one batch's
inputs against another's targets, silently. So before the step each rank fingerprints what it was
given (Note [batch fingerprint] in ``fxpipe.runtime.pipeline.fingerprint``: inputs and targets
apart, each with a digest of their structure, dtypes and shapes) and the ranks of the pipeline
all-gather the fingerprints: 8 int64s per rank, one collective. A part a rank was not given
(``None``) is not compared. Only when two ranks differ, a second gather (of each tensor's
fingerprint, under its pytree path) names the first tensor that differs, so the error says which
tensor, at which step, on which ranks, and how to seed the loader. ``PipelineRunner`` checks every
batch it is given (``check_batches=False`` turns it off); ``fxpipe run`` checks what its data
function yields (``fxpipe.runtime.train.batch_check``, its own wording).
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from fxpipe.runtime.pipeline.fingerprint import fingerprint, tensor_fingerprint
from fxpipe.runtime.pipeline.p2p import peer_error

__all__ = [
    "PARTS",
    "batch_fingerprint",
    "first_disagreement",
    "compare_batch",
    "gather_fingerprints",
    "name_disagreement",
    "Disagreement",
    "runner_message",
]

PARTS = ("inputs", "targets")
_DOING = "comparing the step's batch across the pipeline"


def _part(tree: Any) -> list[int]:
    """[held, digest of the structure, dtypes and shapes, fingerprint a, fingerprint b] of one part."""
    if tree is None:
        return [0, 0, 0, 0]
    leaves, spec = tree_flatten(tree)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    described = repr(
        (
            str(spec),
            [
                (str(x.dtype), tuple(x.shape)) if isinstance(x, torch.Tensor) else repr(x)
                for x in leaves
            ],
        )
    )
    digest = int.from_bytes(
        hashlib.blake2b(described.encode(), digest_size=8).digest(), "little", signed=True
    )
    return [1, digest, *fingerprint(tensors)]


def batch_fingerprint(inputs: Any, targets: Any) -> list[int]:
    """What a rank compares of the batch it holds: its inputs' part, then its targets' part."""
    return _part(inputs) + _part(targets)


def first_disagreement(per_rank: list[list[int]], ranks: list[int]) -> tuple[str, int, int] | None:
    """(part, a rank, another rank whose part differs from it) for the first part that differs, else ``None``.

    >>> first_disagreement([[1, 5, 2, 3, 0, 0, 0, 0], [1, 5, 2, 4, 1, 7, 1, 1]], [0, 1])
    ('inputs', 0, 1)
    >>> first_disagreement([[0, 0, 0, 0, 1, 7, 1, 1], [1, 5, 2, 4, 1, 7, 1, 1]], [0, 1]) is None
    True
    """
    for p, part in enumerate(PARTS):
        held = [(rank, fp[4 * p : 4 * p + 4]) for rank, fp in zip(ranks, per_rank) if fp[4 * p]]
        for rank, fp in held[1:]:
            if fp != held[0][1]:
                return part, held[0][0], rank
    return None


def _leaves(part: str, tree: Any) -> list[tuple[str, Any]]:
    """(``part`` + pytree path, tensor fingerprint with dtype and shape, or the value) of each leaf."""
    if tree is None:
        return []
    out: list[tuple[str, Any]] = []
    for path, leaf in tree_flatten_with_path(tree)[0]:
        name = part + keystr(path)
        if isinstance(leaf, torch.Tensor):
            out.append((name, (str(leaf.dtype), tuple(leaf.shape), tensor_fingerprint(leaf))))
        else:
            out.append((name, repr(leaf)))
    return out


def _first_tensor(mine: list[tuple[str, Any]], theirs: list[tuple[str, Any]], part: str) -> str:
    """The name of the first leaf whose value differs between two ranks' leaves of ``part``."""
    for (name, a), (other, b) in zip(mine, theirs):
        if name != other:
            return f"{part} (its structure: {name} against {other})"
        if a != b:
            if isinstance(a, tuple) and isinstance(b, tuple) and a[:2] != b[:2]:
                return f"{name} ({a[0]}{list(a[1])} against {b[0]}{list(b[1])})"
            return name
    if len(mine) != len(theirs):
        return f"{part} (its structure: {len(mine)} leaves against {len(theirs)})"
    return part


class Disagreement:
    """Ranks of a pipeline that hold different batches: which part, which tensor, which ranks."""

    def __init__(self, part: str, tensor: str, first: int, other: int) -> None:
        self.part, self.tensor, self.first, self.other = part, tensor, first, other


def compare_batch(
    inputs: Any,
    targets: Any,
    *,
    group: Any,
    ranks: list[int],
    device: torch.device,
    rank: int,
    timeout_s: float,
) -> Disagreement | None:
    """Compare the batch this rank holds with the other ranks of its pipeline (collective over
    ``group``, whose members are ``ranks`` in group order); ``None`` when they agree."""
    if len(ranks) == 1:
        return None
    per_rank = gather_fingerprints(
        inputs, targets, group=group, ranks=ranks, device=device, rank=rank, timeout_s=timeout_s
    )
    return name_disagreement(per_rank, inputs, targets, group, ranks, rank, timeout_s)


def gather_fingerprints(
    inputs: Any,
    targets: Any,
    *,
    group: Any,
    ranks: list[int],
    device: torch.device,
    rank: int,
    timeout_s: float,
    extra: Sequence[int] = (),
) -> list[list[int]]:
    """Every rank's batch fingerprint (8 ints) followed by its ``extra`` ints, in group order: one
    all-gather (collective over ``group``). ``extra`` rides along for free (the step's sizes,
    Note [shape formulas]); every rank must give as many."""
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(
        batch_fingerprint(inputs, targets) + list(extra), dtype=torch.int64, device=on
    )
    gathered = [torch.empty_like(mine) for _ in ranks]
    try:
        dist.all_gather(gathered, mine, group=group)
    except RuntimeError as exc:
        raise peer_error(exc, rank, _DOING, timeout_s) from exc
    return [g.tolist() for g in gathered]


def name_disagreement(
    per_rank: list[list[int]],
    inputs: Any,
    targets: Any,
    group: Any,
    ranks: list[int],
    rank: int,
    timeout_s: float,
) -> Disagreement | None:
    """The first tensor that differs between two ranks' gathered fingerprints, else ``None``; a
    second gather (collective, on the error path only: every rank saw the same fingerprints)."""
    found = first_disagreement(per_rank, ranks)
    if found is None:
        return None
    part, first, other = found
    tree = inputs if part == "inputs" else targets
    leaves: list[Any] = [None] * len(ranks)
    try:
        dist.all_gather_object(leaves, _leaves(part, tree), group=group)
    except RuntimeError as exc:
        raise peer_error(exc, rank, _DOING, timeout_s) from exc
    tensor = _first_tensor(leaves[ranks.index(first)], leaves[ranks.index(other)], part)
    return Disagreement(part, tensor, first, other)


def runner_message(found: Disagreement, when: str, replica: int) -> str:
    """``PipelineRunner``'s line for ranks given different batches (``step``, ``forward_backward``,
    ``eval_step``): the step, the tensor, the ranks, how to seed the loader."""
    return (
        f"the ranks of pipeline replica {replica} were given different batches {when}: "
        f"{found.tensor} differs between rank {found.first} and rank {found.other}, but every rank "
        "of a pipeline must be given the same batch (each reads its part of it); seed the loader "
        "alike on these ranks, e.g. DataLoader(..., generator=torch.Generator().manual_seed(seed "
        f"+ {replica})) with the replica's index, not the rank's (or pass check_batches=False to "
        "PipelineRunner to skip this check)"
    )
