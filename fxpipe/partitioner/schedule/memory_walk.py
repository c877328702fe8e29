"""What each rank holds at every moment of a step, counted from the schedule's action lists.

Note [memory over time]: the runtime (``fxpipe.runtime.pipeline.stage_io`` / ``executor``) keeps,
per stage and per microbatch, from its ``F`` until its last backward action (``W`` where
the backward is split, else ``B``): the saved activations, one receive buffer of its
inputs and, once its backward receives were posted, one receive buffer of its output
gradients; every message it sent during the step (outputs after ``F``, input gradients
after ``B``) stays alive until the step ends; between a split ``B`` and its ``W`` the
gradients the weight gradients start from. On gloo the executor posts every receive of
the step when it starts (Note [posting messages] in ``fxpipe.runtime.pipeline.comm``): a buffer per
message; on NCCL each action posts its own. Receive buffers come from a pool that never
shrinks: its size is the most buffers held at once, and all of them are alive through
the step. While a ``B`` runs, the stage also has
its backward temporaries (and, under recomputation, one microbatch's activations again);
the optimizer frees the gradients between steps (``zero_grad(set_to_none=True)``), so a
stage holds them only once its first backward that makes them (``B``, or ``W`` when split)
is done, and a peak during the first one is taken before they exist;
a stage with no input gradient to make (the first) does all of its split backward in
``W``, so there the temporaries come with ``W`` and ``B`` keeps nothing. Beside all of
this, at every moment, a rank holds its weights, optimizer state, buffers, the step's
inputs and, on CUDA, the libraries' workspaces (``RuntimeCosts.workspace_bytes``: cuBLAS's
and cuBLASLt's, 64 MiB on an H100).

``memory_moments`` walks each rank's actions and records, per moment (during each
action and after it), per stage of the rank, the counts ``Holding``; the byte sizes
come from the profile (``fxpipe.partitioner.prediction.rank_peak_memory``), so a
moment's bytes are a dot product and the peak is the largest over the moments: one
matrix-vector product over the rank's counts (``RankMoments.peak``), which the cluster
search asks for hundreds of times per schedule. Cached per schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fxpipe.partitioner.schedule.actions import Action, ActionKind, Schedule

__all__ = ["Holding", "RankMoments", "memory_moments", "schedule_memory_moments"]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
_FIELDS = 7  # the counts of a Holding, in field order


@dataclass(frozen=True)
class Holding:
    """Counts of what one stage holds at one moment (Note [memory over time])."""

    activations: int = (
        0  # microbatches whose activations are saved (F done, last backward action not)
    )
    outputs_sent: int = 0  # output messages posted this step (alive until the step ends)
    grads_sent: int = 0  # input-gradient messages posted this step
    weight_pending: int = 0  # split B done (or running), W not yet: gradients kept for W
    in_backward: int = 0  # 1 while this stage's B runs: its backward temporaries
    in_weight: int = (
        0  # 1 while this stage's W runs (where a split B had no input gradient to make)
    )
    grads: int = (
        0  # 1 once the stage's first weight gradients exist (``.grad`` is freed between steps)
    )


@dataclass(frozen=True, eq=False)
class RankMoments:
    """One rank: its stages, their receive-buffer pools (activations, gradients) and its
    moments: ``counts`` holds one row per moment, the ``Holding`` counts of each stage (in
    ``stages`` order) side by side."""

    stages: tuple[int, ...]
    activation_buffers: tuple[int, ...]
    gradient_buffers: tuple[int, ...]
    counts: np.ndarray = field(repr=False)

    def peak(self, sizes: Sequence[Sequence[int]]) -> int:
        """The largest moment's bytes, ``sizes[k]`` being the bytes per count of stage ``stages[k]``
        (one per ``Holding`` field, in field order)."""
        weights = np.asarray([b for row in sizes for b in row], dtype=np.int64)
        return int((self.counts @ weights).max())

    @property
    def moments(self) -> tuple[tuple[Holding, ...], ...]:
        """The moments no other moment dominates, one ``Holding`` per stage (for reading and tests)."""
        n = len(self.stages)
        return tuple(
            tuple(Holding(*m[_FIELDS * k : _FIELDS * (k + 1)]) for k in range(n))
            for m in _pareto([tuple(int(c) for c in row) for row in self.counts])
        )


def _receives(schedule: Schedule) -> tuple[set[int], set[int]]:
    """Stages whose ``F`` receives activations and whose ``B`` receives gradients from another
    rank: along the chain, where the neighbouring stage sits on another rank."""
    ranks, S = schedule.stage_ranks, schedule.num_stages
    fwd = {s for s in range(1, S) if ranks[s - 1] != ranks[s]}
    bwd = {s for s in range(S - 1) if ranks[s + 1] != ranks[s]}
    return fwd, bwd


def _pareto(moments: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The moments no other moment is at least as large as in every count."""
    unique = sorted(set(moments), key=lambda m: -sum(m))
    kept: list[tuple[int, ...]] = []
    for m in unique:
        if not any(all(a >= b for a, b in zip(k, m)) for k in kept):
            kept.append(m)
    return kept


def memory_moments(schedule: Schedule, step_receives: bool = True) -> tuple[RankMoments, ...]:
    """Per rank, what its stages hold at every moment of one step (Note [memory over time]).

    ``step_receives``: every receive is posted when the step starts (gloo); ``False``: by
    its own action (NCCL's paired sends).
    """
    split = schedule.split_backward()
    recv_f, recv_b = _receives(schedule)
    out: list[RankMoments] = []
    for acts in schedule.actions:
        stages = tuple(sorted({a.stage for a in acts}))
        base = {s: _FIELDS * i for i, s in enumerate(stages)}  # a stage's counts in ``flat``
        n = len(stages)
        flat = [0] * (_FIELDS * n)  # every stage's Holding counts, side by side
        taken = [0] * (
            2 * n
        )  # receive buffers in use: activations of stage c at 2c, gradients at 2c + 1
        pool = [0] * (2 * n)  # ... and the most ever in use: the pool's size
        held: dict[
            tuple[int, int], list[int]
        ] = {}  # (stage, microbatch) -> the buffer slots it holds
        receiving = [
            i
            for i, a in enumerate(acts)
            if (a.kind is F and a.stage in recv_f) or (a.kind is B and a.stage in recv_b)
        ]
        at_action = set() if step_receives else set(receiving)
        moments: set[tuple[int, ...]] = set()

        def post(a: Action) -> None:
            slot = 2 * (base[a.stage] // _FIELDS) + (a.kind is not F)
            held.setdefault((a.stage, a.microbatch), []).append(slot)
            taken[slot] += 1
            if taken[slot] > pool[slot]:
                pool[slot] = taken[slot]

        if step_receives:
            for j in receiving:
                post(acts[j])
        for i, a in enumerate(acts):
            if i in at_action:
                post(a)
            k = base[a.stage]  # flat[k + f] is field f of this stage's Holding
            if a.kind is F:
                flat[k] += 1
                flat[k + 1] += 1
                moments.add(tuple(flat))
                continue
            if a.kind is B:
                is_split = (a.stage, a.microbatch) in split
                flat[k + 4] = 1
                flat[k + 3] += is_split
                moments.add(tuple(flat))
                flat[k + 4] = 0
                flat[k + 2] += 1
                if is_split:
                    continue
            else:
                flat[k + 5] = 1
                moments.add(tuple(flat))
                flat[k + 5] = 0
                flat[k + 3] -= 1
            flat[k + 6] = 1  # the microbatch is done: the stage's gradients exist
            flat[k] -= 1
            for slot in held.pop((a.stage, a.microbatch), ()):
                taken[slot] -= 1
            moments.add(tuple(flat))
        rows = np.asarray(sorted(moments) or [(0,) * (_FIELDS * n)], dtype=np.int64)
        out.append(
            RankMoments(
                stages=stages,
                activation_buffers=tuple(pool[0::2]),
                gradient_buffers=tuple(pool[1::2]),
                counts=rows,
            )
        )
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def schedule_memory_moments(
    name: str, num_ranks: int, virtual_stages: int, microbatches: int, step_receives: bool = True
) -> tuple[RankMoments, ...]:
    """``memory_moments`` of the named schedule (cached: every prediction of a plan asks for it)."""
    from fxpipe.partitioner.schedule.registry import make_schedule

    return memory_moments(
        make_schedule(name, num_ranks, microbatches, virtual_stages), step_receives
    )
