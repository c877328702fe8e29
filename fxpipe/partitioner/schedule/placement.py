"""Where the chunks of a pipeline live: ``loop`` or ``v`` placement of S·V chunks on S ranks.

Interleaved schedules place chunk ``c`` on rank ``c % S`` (``loop``: rank r holds
r, r+S, r+2S, ...). V-shaped ones run down the ranks and back up (``v``: rank r holds
r and 2S-1-r for V = 2, zigzagging for larger V), so the middle pair of chunks sits on
the last rank and exchanges no message. With one chunk per rank both are the identity.

>>> stage_ranks(2, 2, "loop"), stage_ranks(2, 2, "v")
((0, 1, 0, 1), (0, 1, 1, 0))
"""

from __future__ import annotations

from fxpipe.errors import PartitionError

__all__ = ["PLACEMENTS", "placement_of", "placements_of", "stage_ranks"]

PLACEMENTS = ("loop", "v")


def stage_ranks(num_ranks: int, virtual_stages: int, placement: str = "loop") -> tuple[int, ...]:
    """The rank of each of the ``num_ranks x virtual_stages`` chunks under ``placement``."""
    if num_ranks < 1 or virtual_stages < 1:
        raise PartitionError(
            f"need >= 1 rank and >= 1 virtual stage, got {num_ranks} and {virtual_stages}"
        )
    if placement not in PLACEMENTS:
        raise PartitionError(f"unknown placement {placement!r}; expected one of {list(PLACEMENTS)}")
    out = []
    for c in range(num_ranks * virtual_stages):
        block, pos = divmod(c, num_ranks)
        out.append(num_ranks - 1 - pos if placement == "v" and block % 2 else pos)
    return tuple(out)


def placement_of(ranks: tuple[int, ...] | list[int]) -> tuple[int, int, str]:
    """(ranks, chunks per rank, placement) of a stage -> rank map; ``PartitionError`` when it is
    neither a loop nor a V placement of equally many chunks per rank."""
    num_ranks, v, styles = placements_of(ranks)
    return num_ranks, v, styles[0]


def placements_of(ranks: tuple[int, ...] | list[int]) -> tuple[int, int, tuple[str, ...]]:
    """(ranks, chunks per rank, every placement that gives this stage -> rank map): on one rank,
    or with one chunk per rank, the loop and the V are the same map, and either's schedules run it.

    >>> placements_of((0, 1, 1, 0)), placements_of((0, 0))
    ((2, 2, ('v',)), (1, 2, ('loop', 'v')))
    """
    num_ranks = 1 + max(ranks, default=0)
    chunks = len(ranks)
    if chunks % num_ranks == 0:
        v = chunks // num_ranks
        styles = tuple(s for s in PLACEMENTS if tuple(ranks) == stage_ranks(num_ranks, v, s))
        if styles:
            return num_ranks, v, styles
    raise PartitionError(
        f"stage ranks {list(ranks)} are neither a loop nor a V placement of the same number "
        "of stages on every rank; rebuild with `fxpipe partition --virtual-stages V`"
    )
