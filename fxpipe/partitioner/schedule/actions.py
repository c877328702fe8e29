"""Schedules as data: ``Action`` (what one rank computes next) and ``Schedule`` (every rank's list).

A schedule never touches torch: it is a pure value that the planner simulates, the
validator checks and the runtime executes (``fxpipe.runtime.pipeline.executor``). Stages here are
the build's *chunks* (``stage_i.py``); ``Schedule.stage_ranks`` says which pipeline rank
holds each one, so a rank may run several (interleaved and V-shaped schedules).

Note [split backward]: ``B`` of (stage, microbatch) computes the gradients of the
stage's inputs and sends them on. When the schedule also holds ``W`` for that (stage,
microbatch), ``B`` computes input gradients only and ``W`` the weight gradients later
(zero-bubble schedules); without a ``W`` it is the fused backward of GPipe and 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from fxpipe.errors import ScheduleError

__all__ = ["ActionKind", "Action", "Schedule"]


class ActionKind(str, Enum):
    """What an action computes (Note [split backward])."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


_KINDS = {k.value: k for k in ActionKind}


@dataclass(frozen=True, init=False)
class Action:
    """Run ``kind`` of ``stage`` on ``microbatch``; printed as ``"1F0"``, ``"0B3"``, ``"2W1"``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __init__(self, stage: int, kind: ActionKind | str, microbatch: int) -> None:
        if stage < 0 or microbatch < 0:
            raise ValueError(f"stage and microbatch must be >= 0, got {stage} and {microbatch}")
        # A frozen dataclass's own __init__ sets each field through object.__setattr__: 4x slower,
        # and the cluster search builds a million actions. Frozen still holds for every later write.
        fields = self.__dict__
        fields["stage"], fields["microbatch"] = stage, microbatch
        fields["kind"] = kind if kind.__class__ is ActionKind else ActionKind(kind)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1F0") == Action(1, ActionKind.FORWARD, 0)``."""
        for value, kind in _KINDS.items():
            stage, sep, mb = text.partition(value)
            if sep and stage.isdigit() and mb.isdigit():
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0', '0B3' or '2W1'")


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the actions it executes in order; ``stage_ranks[s]`` is stage s's rank.

    >>> s = Schedule("mine", 2, 1, ((Action(0, "F", 0), Action(0, "B", 0)), (Action(1, "F", 0), Action(1, "B", 0))))
    >>> str(s).splitlines()[1]
    '  rank 0: 0F0 0B0'
    """

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
            raise ScheduleError(
                f"schedule {self.name!r}: stage_ranks has {len(self.stage_ranks)} entries for "
                f"{self.num_stages} stages; give one rank per stage"
            )
        if any(not 0 <= r < len(self.actions) for r in self.stage_ranks):
            raise ScheduleError(
                f"schedule {self.name!r}: stage_ranks {list(self.stage_ranks)} name ranks outside "
                f"0..{len(self.actions) - 1} (one action list per rank)"
            )

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def virtual_stages(self) -> int:
        """Stages per rank (1 for GPipe and 1F1B)."""
        return max(1, self.num_stages // max(self.num_ranks, 1))

    def rank_actions(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in stage order."""
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def split_backward(self) -> frozenset[tuple[int, int]]:
        """The (stage, microbatch) pairs whose backward is split into ``B`` and ``W`` (Note [split backward])."""
        return frozenset(
            (a.stage, a.microbatch)
            for acts in self.actions
            for a in acts
            if a.kind is ActionKind.WEIGHT
        )

    def __str__(self) -> str:
        lines = [
            f"{self.name}: {self.num_stages} stages on {self.num_ranks} ranks, "
            f"{self.num_microbatches} microbatches"
        ]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON data: the action lists as strings (``"1F0 1B0"`` per rank)."""
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_ranks": list(self.stage_ranks),
            "actions": [" ".join(str(a) for a in acts) for acts in self.actions],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        """Inverse of ``to_dict`` (a user's own schedule written as JSON)."""
        try:
            actions = tuple(
                tuple(Action.parse(a) for a in str(line).split()) for line in data["actions"]
            )
            return cls(
                str(data["name"]),
                int(data["num_stages"]),
                int(data["num_microbatches"]),
                actions,
                tuple(int(r) for r in data.get("stage_ranks", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(
                f"malformed schedule data ({exc}); expected name, num_stages, num_microbatches, "
                "stage_ranks and actions (one string of actions such as '0F0 0B0' per rank)"
            ) from None
