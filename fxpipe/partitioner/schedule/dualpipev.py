"""DualPipeV (DeepSeek-V3's DualPipe folded into a V, arXiv 2412.19437): two chunks per rank, V-shaped.

Rank r holds chunk r on the way down and chunk 2S-1-r on the way back up (as in ZBV). Its
steady state pairs a forward of one chunk with a full backward of the other, so that on
hardware which overlaps them the communication of one hides behind the compute of the
other; here a pair runs as its forward, then its backward. Only the end of the warm-up
(step 3) and the cool-down split the backward (``B`` now, ``W`` from a queue of pending
weight work where a rank would otherwise wait), so fewer microbatches' activations wait
for their ``W`` than under ZBV. Rank r runs, with ``F1``/``B1`` its first chunk and ``F2``/
``B2`` its second (``B`` is fused unless marked split):

1. ``2(S - r - 1)`` ``F1``;
2. ``r + 1`` pairs ``F1``, ``F2``;
3. ``S - r - 1`` times: split ``B2``, one pending ``W``, ``F2``;
4. ``M - 2S + r + 1`` times: ``F1`` with ``B2``, then ``F2`` with ``B1``;
5. ``S - r - 1`` times: ``B2``, then ``F2`` with ``B1``;
6. ``r + 1`` pairs ``B2``, ``B1``, split from the middle pair on (from its ``B2`` on odd
   ranks, from its ``B1`` on even ones);
7. ``S - r - 1`` times: one pending ``W``, then ``B1`` (split once step 6 turned splitting on);
8. the pending ``W``s.

The pattern needs ``M >= 2S``; for fewer microbatches it is laid out for ``2S`` and the
ones beyond M are dropped (a shorter run of the same pattern, as ZBV does).
"""

from __future__ import annotations

from collections import deque

from fxpipe.partitioner.schedule.actions import Action, ActionKind

__all__ = ["dualpipev_actions"]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


class _Rank:
    """One rank's action list as it is laid out: counters per (chunk, kind) and the pending ``W``s."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[int, ActionKind], int] = {}
        self.pending: deque[Action] = deque()

    def forward(self, chunk: int) -> None:
        self._add(chunk, F)

    def backward(self, chunk: int, split: bool = False) -> None:
        m = self._add(chunk, B)
        if split:
            self.pending.append(Action(chunk, W, m))

    def weight(self) -> None:
        """The oldest pending ``W``, if any."""
        if self.pending:
            self.actions.append(self.pending.popleft())

    def _add(self, chunk: int, kind: ActionKind) -> int:
        m = self.next.get((chunk, kind), 0)
        self.next[(chunk, kind)] = m + 1
        self.actions.append(Action(chunk, kind, m))
        return m


def dualpipev_actions(num_ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions under DualPipeV (see the module docstring)."""
    S, M = num_ranks, microbatches
    n = max(M, 2 * S)
    out = []
    for r in range(S):
        first, second = r, 2 * S - 1 - r
        rank = _Rank()
        for _ in range(2 * (S - r - 1)):
            rank.forward(first)
        for _ in range(r + 1):
            rank.forward(first)
            rank.forward(second)
        for _ in range(S - r - 1):
            rank.backward(second, split=True)
            rank.weight()
            rank.forward(second)
        for _ in range(n - 2 * S + r + 1):
            rank.forward(first)
            rank.backward(second)
            rank.forward(second)
            rank.backward(first)
        for _ in range(S - r - 1):
            rank.backward(second)
            rank.forward(second)
            rank.backward(first)
        split = False
        middle = (r + 1) // 2
        for i in range(r + 1):
            split = split or (i == middle and r % 2 == 1)
            rank.backward(second, split)
            split = split or (i == middle and r % 2 == 0)
            rank.backward(first, split)
        for _ in range(S - r - 1):
            rank.weight()
            rank.backward(first, split)
        while rank.pending:
            rank.weight()
        assert all(rank.next.get((c, k), 0) == n for c in (first, second) for k in (F, B)), (
            "DualPipeV pattern lost an action"
        )
        out.append(tuple(a for a in rank.actions if a.microbatch < M))
    return tuple(out)
