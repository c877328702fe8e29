"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): V chunks per rank, placed loop-style.

Rank r holds chunks r, r+S, ..., r+(V-1)S. Microbatches go through the chunks in rounds
of ``R`` (``R = M // max(1, M // S)``, so M = S gives R = S and M = 2S two rounds of S;
M must be a multiple of the rounds): forwards take chunk 0 for R microbatches, then
chunk 1 for the same R, ...; backwards take the chunks in the reverse order. A rank
warms up with ``(V - 1) R + 2 (S - 1 - r)`` forwards, then alternates one forward and
one backward, then drains. Each chunk is 1/V of a stage, so the warm-up and drain
bubbles shrink V-fold; the price is V times more messages. 2 ranks, V = 2, M = 2::

    rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
"""

from __future__ import annotations

from fxpipe.errors import ScheduleError
from fxpipe.partitioner.schedule.actions import Action, ActionKind

__all__ = ["interleaved_1f1b_actions", "rounds"]


def rounds(num_ranks: int, microbatches: int) -> int:
    """Microbatches per round; ``ScheduleError`` when M is not a multiple of the rounds."""
    count = max(1, microbatches // num_ranks)
    if microbatches % count:
        raise ScheduleError(
            f"interleaved schedules run the {microbatches} microbatches in {count} rounds of "
            f"{microbatches // count}, which needs a multiple of {count}; use "
            f"{microbatches - microbatches % count} or {microbatches - microbatches % count + count} "
            "microbatches"
        )
    return microbatches // count


def interleaved_1f1b_actions(
    num_ranks: int, virtual_stages: int, microbatches: int
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions under interleaved 1F1B (see the module docstring)."""
    S, V, M = num_ranks, virtual_stages, microbatches
    per_round = rounds(S, M)
    total = M * V
    out = []
    for r in range(S):
        warmup = min((V - 1) * per_round + 2 * (S - 1 - r), total)
        fwd_next = [0] * V
        bwd_next = [0] * V

        def forward(k: int) -> Action:
            local = (k // per_round) % V
            fwd_next[local] += 1
            return Action(local * S + r, ActionKind.FORWARD, fwd_next[local] - 1)

        def backward(k: int) -> Action:
            local = V - 1 - (k // per_round) % V
            bwd_next[local] += 1
            return Action(local * S + r, ActionKind.BACKWARD, bwd_next[local] - 1)

        acts = [forward(k) for k in range(warmup)]
        for k in range(warmup, total):
            acts += [forward(k), backward(k - warmup)]
        acts += [backward(k) for k in range(total - warmup, total)]
        out.append(tuple(acts))
    return tuple(out)
