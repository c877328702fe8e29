"""The schedules fxpipe plans and runs, by name: the one list the CLI, RunOptions, the planner and the runtime use.

Each entry says how its chunks are placed (``placement``), how many chunks per rank it
takes, whether it splits the backward (Note [split backward] in ``actions``) and how it
builds the per-rank action lists. A schedule runs on a build whose chunks are placed
the way it needs: ``compatible(name, virtual_stages, placement)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from fxpipe.errors import ScheduleError
from fxpipe.partitioner.schedule.actions import Action, ActionKind, Schedule
from fxpipe.partitioner.schedule.dualpipev import dualpipev_actions
from fxpipe.partitioner.schedule.interleaved import interleaved_1f1b_actions
from fxpipe.partitioner.schedule.one_chunk import stage_order
from fxpipe.partitioner.schedule.placement import stage_ranks
from fxpipe.partitioner.schedule.zbv import zbv_actions

__all__ = [
    "ScheduleKind",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "AUTO",
    "make_schedule",
    "schedule_kind",
    "compatible",
    "runnable_schedules",
]

AUTO = "auto"  # --schedule auto: the planner tries every schedule (and V) and keeps the fastest that fits


_KIND = {
    k.value: k for k in ActionKind
}  # a dict lookup: ActionKind(value) costs a microsecond per action


def _one_chunk(name: str) -> Callable[[int, int, int], tuple[tuple[Action, ...], ...]]:
    def build(
        num_ranks: int, virtual_stages: int, microbatches: int
    ) -> tuple[tuple[Action, ...], ...]:
        return tuple(
            tuple(Action(s, _KIND[k], m) for k, m in stage_order(name, num_ranks, microbatches, s))
            for s in range(num_ranks)
        )

    return build


@dataclass(frozen=True)
class ScheduleKind:
    """One named schedule: its chunk placement, chunks per rank (``min_virtual``..``max_virtual``,
    ``None``: no upper limit), whether it splits the backward, and its action-list builder."""

    name: str
    placement: str
    min_virtual: int
    max_virtual: int | None
    split_backward: bool
    build: Callable[[int, int, int], tuple[tuple[Action, ...], ...]]
    summary: str

    @property
    def default_virtual(self) -> int:
        return self.min_virtual

    def check_virtual(self, virtual_stages: int) -> None:
        hi = self.max_virtual
        if virtual_stages < self.min_virtual or (hi is not None and virtual_stages > hi):
            want = (
                str(self.min_virtual)
                if hi == self.min_virtual
                else (f"{self.min_virtual} or more" if hi is None else f"{self.min_virtual}..{hi}")
            )
            raise ScheduleError(
                f"schedule {self.name!r} runs {want} stages per rank, not --virtual-stages "
                f"{virtual_stages}; use --virtual-stages {self.default_virtual} or another schedule"
            )


SCHEDULES: dict[str, ScheduleKind] = {
    k.name: k
    for k in (
        ScheduleKind(
            "gpipe", "loop", 1, 1, False, _one_chunk("gpipe"), "all forwards, then all backwards"
        ),
        ScheduleKind(
            "1f1b",
            "loop",
            1,
            1,
            False,
            _one_chunk("1f1b"),
            "one forward, one backward (PipeDream-flush)",
        ),
        ScheduleKind(
            "interleaved-1f1b",
            "loop",
            2,
            None,
            False,
            lambda s, v, m: interleaved_1f1b_actions(s, v, m),
            "1F1B over V loop-placed chunks per rank",
        ),
        ScheduleKind(
            "zb-h1",
            "loop",
            1,
            1,
            True,
            _one_chunk("zb-h1"),
            "1F1B with weight gradients deferred (zero bubble H1)",
        ),
        ScheduleKind(
            "zbv",
            "v",
            2,
            2,
            True,
            lambda s, v, m: zbv_actions(s, m),
            "zero bubble over 2 V-placed chunks per rank",
        ),
        ScheduleKind(
            "dualpipev",
            "v",
            2,
            2,
            True,
            lambda s, v, m: dualpipev_actions(s, m),
            "DualPipeV: forward of one chunk paired with backward of the other, 2 V-placed chunks per rank",
        ),
    )
}

SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_kind(name: str) -> ScheduleKind:
    """The schedule called ``name``; ``ScheduleError`` listing the known ones otherwise."""
    try:
        return SCHEDULES[name.lower()]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; expected one of {list(SCHEDULE_NAMES)}"
        ) from None


def compatible(name: str, virtual_stages: int, placement: str) -> bool:
    """Whether schedule ``name`` runs on chunks placed ``placement`` with ``virtual_stages`` per rank."""
    kind = schedule_kind(name)
    hi = kind.max_virtual
    fits = kind.min_virtual <= virtual_stages and (hi is None or virtual_stages <= hi)
    return fits and (virtual_stages == 1 or kind.placement == placement)


def runnable_schedules(virtual_stages: int, placement: str) -> tuple[str, ...]:
    """The schedules a build with this placement can run."""
    return tuple(n for n in SCHEDULE_NAMES if compatible(n, virtual_stages, placement))


@functools.lru_cache(
    maxsize=64
)  # immutable; the cluster search asks for one schedule several times
def make_schedule(
    name: str, num_ranks: int, microbatches: int, virtual_stages: int | None = None
) -> Schedule:
    """The schedule ``name`` for ``num_ranks`` ranks, ``microbatches`` and ``virtual_stages``
    chunks per rank (default: the schedule's least).

    >>> print(make_schedule("zbv", 2, 2))
    zbv: 4 stages on 2 ranks, 2 microbatches
      rank 0: 0F0 0F1 3F0 3B0 3W0 3F1 3B1 3W1 0B0 0W0 0B1 0W1
      rank 1: 1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 2B1 2W1 1B1 1W1
    """
    kind = schedule_kind(name)
    v = kind.default_virtual if virtual_stages is None else virtual_stages
    kind.check_virtual(v)
    if num_ranks < 1 or microbatches < 1:
        raise ScheduleError(
            f"need >= 1 rank and >= 1 microbatch, got {num_ranks} and {microbatches}"
        )
    actions = kind.build(num_ranks, v, microbatches)
    return Schedule(
        kind.name, num_ranks * v, microbatches, actions, stage_ranks(num_ranks, v, kind.placement)
    )
