"""Pipeline schedules as data: pure functions that return each rank's list of actions.

A schedule never touches torch. The runtime only executes the lists; the validator in
``fxpipe.runtime.validate`` checks them. Communication is implied by the actions
(see Note [implied communication] in ``fxpipe.runtime.executor``): ``F`` on a stage
receives that microbatch's activations from its producers and sends its outputs on,
``B`` receives gradients from its consumers and sends gradients back.

``Schedule.stage_ranks`` maps each stage to the pipeline rank that runs it. GPipe and
1F1B place stage ``i`` on rank ``i``; interleaved schedules (several stages per rank)
and zero-bubble ones (a separate ``W`` weight-gradient action) fit the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fxpipe.partitioner.schedule import stage_order

__all__ = ["ActionKind", "Action", "Schedule", "gpipe", "one_f_one_b", "make_schedule", "SCHEDULES"]


class ActionKind(str, Enum):
    """What an action computes. ``W`` is reserved for zero-bubble schedules."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


@dataclass(frozen=True)
class Action:
    """Run ``kind`` of ``stage`` on ``microbatch``; printed as ``"1F0"``, ``"0B3"``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0, got {self.stage} and {self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1F0") == Action(1, ActionKind.FORWARD, 0)``."""
        for kind in ActionKind:
            stage, sep, mb = text.partition(kind.value)
            if sep and stage.isdigit() and mb.isdigit():
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0' or '0B3'")


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the actions it executes in order."""

    name: str
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if not self.stage_ranks:
            object.__setattr__(self, "stage_ranks", tuple(range(self.num_stages)))
        object.__setattr__(self, "stage_ranks", tuple(self.stage_ranks))
        if len(self.stage_ranks) != self.num_stages:
            raise ValueError(f"stage_ranks has {len(self.stage_ranks)} entries for {self.num_stages} stages")

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.num_stages} stages, {self.num_microbatches} microbatches"]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need >= 1 stage and >= 1 microbatch, got {num_stages} and {num_microbatches}")


def _from_orders(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Rank i runs stage i in the order ``partitioner.schedule.stage_order`` gives: one
    source of truth for the order the planner simulates and the runtime executes."""
    _check_sizes(num_stages, num_microbatches)
    actions = tuple(
        tuple(Action(s, ActionKind(kind), m) for kind, m in stage_order(name, num_stages, num_microbatches, s))
        for s in range(num_stages)
    )
    return Schedule(name, num_stages, num_microbatches, actions)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (in the same microbatch order).

    Simple and bubble-heavy; every stage keeps all M microbatches' activations
    (timeline from ``validate.simulate``, one column per unit step)::

        rank 0: 0F0 0F1 0F2 .   .   .   .   0B0 0B1 0B2
        rank 1: .   1F0 1F1 1F2 .   .   1B0 1B1 1B2 .
        rank 2: .   .   2F0 2F1 2F2 2B0 2B1 2B2 .   .

    Backwards run in forward order so the gradient messages between two stages
    arrive in the same order as the activations did.
    """
    return _from_orders("gpipe", num_stages, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm up, then alternate one forward and one backward.

    Stage ``i`` runs ``min(S - 1 - i, M)`` warm-up forwards, then pairs
    ``F(k), B(k - warmup)``, then drains the remaining backwards. At most ``S - i``
    microbatches are in flight on stage ``i`` (vs M for GPipe), so activation memory is
    bounded by the depth of the pipeline, with the same bubble as GPipe
    (timeline from ``validate.simulate``)::

        rank 0: 0F0 0F1 0F2 .   .   0B0 0F3 0B1 .   0B2 .   0B3
        rank 1: .   1F0 1F1 .   1B0 1F2 1B1 1F3 1B2 .   1B3 .
        rank 2: .   .   2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 .   .
    """
    return _from_orders("1f1b", num_stages, num_microbatches)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called ``name`` (``"gpipe"`` or ``"1f1b"``)."""
    from fxpipe.errors import ConfigError

    try:
        fn = SCHEDULES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown schedule {name!r}; expected one of {sorted(SCHEDULES)}") from None
    return fn(num_stages, num_microbatches)
