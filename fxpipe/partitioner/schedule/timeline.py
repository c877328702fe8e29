"""The simulator's data: links between stages, a rank's prepared actions, and the timed step.

``simulator.simulate_step`` prepares each rank's actions (``PreparedRank``: durations and what
each waits for, Note [step simulation] in ``simulator``) and runs them, alone
(``simulator``) or on shared cores (``sharing``); both return a ``Timeline``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fxpipe.partitioner.schedule.actions import Action, ActionKind

__all__ = [
    "Link",
    "chain_links",
    "link_index",
    "ScheduleOp",
    "Timeline",
    "SimulationStuck",
    "dependencies",
    "PreparedRank",
]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


@dataclass(frozen=True)
class Link:
    """Stage ``src`` sends activations to ``dst``; ``grad`` says gradients come back."""

    src: int
    dst: int
    grad: bool = True


def chain_links(num_stages: int) -> tuple[Link, ...]:
    """Links of a plain chain: stage i feeds stage i + 1."""
    return tuple(Link(i, i + 1) for i in range(num_stages - 1))


def link_index(links: Sequence[Link]) -> tuple[dict[int, list[Link]], dict[int, list[Link]]]:
    """The links into each stage (from its producers) and out of it (to its consumers)."""
    producers: dict[int, list[Link]] = {}
    consumers: dict[int, list[Link]] = {}
    for ln in links:
        producers.setdefault(ln.dst, []).append(ln)
        consumers.setdefault(ln.src, []).append(ln)
    return producers, consumers


@dataclass(frozen=True)
class ScheduleOp:
    """One simulated action: ``kind`` of ``stage`` on ``microbatch``, on ``rank``, from start to end."""

    stage: int
    microbatch: int
    kind: str
    start_ms: float
    end_ms: float
    rank: int = -1

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """Every action of one simulated step, and what it adds up to."""

    schedule: str
    microbatches: int
    ops: tuple[ScheduleOp, ...]
    num_ranks: int = 0

    def __post_init__(self) -> None:
        if not self.num_ranks:
            object.__setattr__(
                self,
                "num_ranks",
                1 + max((op.rank if op.rank >= 0 else op.stage) for op in self.ops)
                if self.ops
                else 1,
            )

    @property
    def num_stages(self) -> int:
        return 1 + max(op.stage for op in self.ops)

    @property
    def step_ms(self) -> float:
        return max((op.end_ms for op in self.ops), default=0.0)

    def busy_ms(self) -> list[float]:
        """Compute time of each rank."""
        busy = [0.0] * self.num_ranks
        for op in self.ops:
            busy[op.rank if op.rank >= 0 else op.stage] += op.end_ms - op.start_ms
        return busy

    @property
    def bubble(self) -> float:
        """Idle share of the ranks x step-time rectangle."""
        total = self.step_ms * self.num_ranks
        return 1.0 - sum(self.busy_ms()) / total if total > 0 else 0.0


class SimulationStuck(Exception):
    """No rank can run its next action: ``positions[r]`` is rank r's next action, ``done`` what finished."""

    def __init__(self, positions: list[int], done: dict[Action, float]) -> None:
        super().__init__("schedule deadlocked")
        self.positions = positions
        self.done = done


def dependencies(
    action: Action,
    producers: Mapping[int, Sequence[Link]],
    consumers: Mapping[int, Sequence[Link]],
    split: bool,
) -> list[tuple[Action, Link | None]]:
    """What ``action`` waits for (Note [step simulation]), each with the link its message crosses."""
    s, m = action.stage, action.microbatch
    if action.kind is F:
        return [(Action(ln.src, F, m), ln) for ln in producers.get(s, ())]
    if action.kind is B:
        return [(Action(s, F, m), None)] + [
            (Action(ln.dst, B, m), ln) for ln in consumers.get(s, ()) if ln.grad
        ]
    return [(Action(s, B, m), None)] if split else []


@dataclass
class PreparedRank:
    """One rank's actions with their durations and what they wait for (delays included)."""

    actions: list[Action] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    waits: list[list[tuple[Action, float]]] = field(default_factory=list)
    stalls: list[float] = field(
        default_factory=list
    )  # paid first where the action starts on busy cores
    prologue: float = (
        0.0  # compute at the step's start, before the first action (posting its receives)
    )
