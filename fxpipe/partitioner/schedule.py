"""A pure-Python simulator of GPipe and 1F1B pipeline schedules.

Each stage runs its operations in the schedule's order; an operation starts when its
stage is free and its input is ready: ``F(i, m)`` needs ``F(i-1, m)`` (plus the link
delay ``send_ms[i-1]``), ``B(i, m)`` needs ``B(i+1, m)`` (plus ``send_ms[i]``), and on
the last stage ``B(S-1, m)`` needs ``F(S-1, m)``. Per-stage order, 4 microbatches,
3 stages::

    GPipe   stage i: F0 F1 F2 F3 B0 B1 B2 B3
    1F1B    stage 0: F0 F1 F2 B0 F3 B1 B2 B3     (S - 1 - i warm-up forwards)
            stage 1: F0 F1 B0 F2 B1 F3 B2 B3
            stage 2: F0 B0 F1 B1 F2 B2 F3 B3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.errors import PartitionError

__all__ = ["SCHEDULE_NAMES", "ScheduleOp", "Timeline", "stage_order", "simulate_schedule"]

# The schedules fxpipe plans and runs: the one list the CLI, RunOptions and the runtime check names against.
SCHEDULE_NAMES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class ScheduleOp:
    """One forward (``kind="F"``) or backward (``"B"``) of one microbatch on one stage."""

    stage: int
    microbatch: int
    kind: str
    start_ms: float
    end_ms: float

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Timeline:
    """Every op of one simulated step, and what it adds up to."""

    schedule: str
    microbatches: int
    ops: tuple[ScheduleOp, ...]

    @property
    def num_stages(self) -> int:
        return 1 + max(op.stage for op in self.ops)

    @property
    def step_ms(self) -> float:
        return max(op.end_ms for op in self.ops)

    @property
    def bubble(self) -> float:
        """Idle share of the stages x step-time rectangle."""
        busy = sum(op.end_ms - op.start_ms for op in self.ops)
        total = self.step_ms * self.num_stages
        return 1.0 - busy / total if total > 0 else 0.0


def stage_order(schedule: str, num_stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The (kind, microbatch) sequence that ``stage`` runs under ``schedule``."""
    M = microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if schedule != "1f1b":
        raise PartitionError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULE_NAMES)}")
    warmup = min(num_stages - 1 - stage, M)
    order = [("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < M:
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    order += [("B", m) for m in range(b, M)]
    return order


def simulate_schedule(fwd_ms: Sequence[float], bwd_ms: Sequence[float], microbatches: int,
                      schedule: str = "1f1b", *, send_ms: Sequence[float] | None = None,
                      grad_send_ms: Sequence[float] | None = None) -> Timeline:
    """Start and end time of every (stage, microbatch, F/B) op of one training step.

    ``fwd_ms[i]`` / ``bwd_ms[i]`` are stage i's time for one microbatch (communication
    included, as the cost model counts it); ``send_ms[i]`` is an extra delay on the link
    from stage i to i+1 for activations (default none) and ``grad_send_ms[i]`` the delay
    of gradients going back from stage i+1 to i (default: ``send_ms``).

    >>> simulate_schedule([1, 1], [2, 2], 2, "gpipe").step_ms
    9.0
    >>> simulate_schedule([1, 1], [2, 2], 2, "gpipe", send_ms=[0.5, 0], grad_send_ms=[0.25, 0]).step_ms
    9.75
    """
    S, M = len(fwd_ms), microbatches
    if S == 0 or len(bwd_ms) != S:
        raise PartitionError(f"need one forward and one backward time per stage, got {len(fwd_ms)} and {len(bwd_ms)}")
    if M < 1:
        raise PartitionError(f"microbatches must be >= 1, got {M}")
    delay = list(send_ms) if send_ms is not None else [0.0] * S
    grad_delay = list(grad_send_ms) if grad_send_ms is not None else delay
    if len(delay) < S - 1 or len(grad_delay) < S - 1:
        raise PartitionError(f"need a link delay for each of the {S - 1} links between {S} stages, "
                             f"got {len(delay)} forward and {len(grad_delay)} backward")
    orders = [stage_order(schedule, S, M, i) for i in range(S)]
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * S
    pos = [0] * S
    ops: list[ScheduleOp] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(S):
            while pos[i] < len(orders[i]):
                kind, m = orders[i][pos[i]]
                if kind == "F":
                    dep = ("F", i - 1, m) if i > 0 else None
                    lag = delay[i - 1] if i > 0 else 0.0
                else:
                    dep = ("B", i + 1, m) if i < S - 1 else ("F", i, m)
                    lag = grad_delay[i] if i < S - 1 else 0.0
                if dep is not None and dep not in end:
                    break
                ready = end[dep] + lag if dep is not None else 0.0
                start = max(free[i], ready)
                finish = start + (fwd_ms[i] if kind == "F" else bwd_ms[i])
                end[(kind, i, m)] = finish
                free[i] = finish
                ops.append(ScheduleOp(i, m, kind, start, finish))
                pos[i] += 1
                remaining -= 1
                progressed = True
        assert progressed, "schedule deadlocked"
    ops.sort(key=lambda op: (op.start_ms, op.stage))
    return Timeline(schedule=schedule, microbatches=M, ops=tuple(ops))
