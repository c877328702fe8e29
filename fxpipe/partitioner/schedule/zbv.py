"""ZBV (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): two chunks per rank, V-shaped.

Rank r holds chunk r (on the way down) and chunk 2S-1-r (on the way back up), so the
last rank holds the two middle chunks and the first rank both ends: the loss is
computed on rank 0, and the chunks S-1 and S exchange no message. With the backward
split into ``B`` (input gradients) and ``W`` (weight gradients), rank r runs:

1. ``2(S - r) - 1`` forwards of its first chunk;
2. ``r`` pairs: a forward of the second chunk, a forward of the first;
3. ``S - r`` triples on the second chunk: F, B, W;
4. steady state, until every forward ran: [F, B, W of the first chunk], [F, B, W of the second];
5. drain: ``r`` pairs of B (first chunk, second chunk), then ``S - r`` pairs B, W of the
   first chunk, then the remaining W's (second chunk, then first).

The pattern is laid out for ``max(M, 2S - 1)`` microbatches and the ones beyond M are
dropped, as a shorter run of the same pattern. With equal F, B and W times its bubble
is close to zero at the peak activation memory of 1F1B.
"""

from __future__ import annotations

from fxpipe.partitioner.schedule.actions import Action, ActionKind

__all__ = ["zbv_actions"]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def zbv_actions(num_ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions under ZBV (see the module docstring)."""
    S, M = num_ranks, microbatches
    n = max(M, 2 * S - 1)
    out = []
    for r in range(S):
        first, second = r, 2 * S - 1 - r
        count = {
            (first, F): 0,
            (first, B): 0,
            (first, W): 0,
            (second, F): 0,
            (second, B): 0,
            (second, W): 0,
        }
        acts: list[Action] = []

        def run(stage: int, kind: ActionKind) -> None:
            acts.append(Action(stage, kind, count[(stage, kind)]))
            count[(stage, kind)] += 1

        for _ in range(2 * (S - r) - 1):
            run(first, F)
        for _ in range(r):
            run(second, F)
            run(first, F)
        for _ in range(S - r):
            run(second, F)
            run(second, B)
            run(second, W)
        while count[(second, F)] < count[(first, F)] or count[(first, F)] < n:
            if count[(first, F)] < n:
                run(first, F)
            run(first, B)
            run(first, W)
            run(second, F)
            run(second, B)
            run(second, W)
        for _ in range(r):
            run(first, B)
            run(second, B)
        for _ in range(S - r):
            run(first, B)
            run(first, W)
        while count[(second, W)] < count[(second, B)]:
            run(second, W)
        while count[(first, W)] < count[(first, B)]:
            run(first, W)
        assert all(count[(s, k)] == n for s in (first, second) for k in (F, B, W)), (
            "ZBV pattern lost an action"
        )
        out.append(tuple(a for a in acts if a.microbatch < M))
    return tuple(out)
