"""``simulate_schedule``: the one-stage-per-rank simulator's older call form, on ``simulate_step``."""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.errors import PartitionError
from fxpipe.partitioner.schedule.actions import ActionKind
from fxpipe.partitioner.schedule.registry import make_schedule
from fxpipe.partitioner.schedule.simulator import Link, Timeline, simulate_step

__all__ = ["simulate_schedule"]


def simulate_schedule(fwd_ms: Sequence[float], bwd_ms: Sequence[float], microbatches: int,
                      schedule: str = "1f1b", *, send_ms: Sequence[float] | None = None,
                      grad_send_ms: Sequence[float] | None = None) -> Timeline:
    """Start and end time of every (stage, microbatch, F/B) op of one training step, one stage per rank.

    ``fwd_ms[i]`` / ``bwd_ms[i]`` are stage i's time for one microbatch; ``send_ms[i]`` is
    an extra delay on the link from stage i to i+1 for activations (default none) and
    ``grad_send_ms[i]`` the delay of gradients going back from stage i+1 to i (default:
    ``send_ms``). A schedule that splits the backward gets all of ``bwd_ms`` in ``B``.

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
    times = {ActionKind.FORWARD: fwd_ms, ActionKind.BACKWARD: bwd_ms}

    def lag(link: Link, kind: ActionKind) -> float:
        return float(delay[link.src] if kind is ActionKind.FORWARD else grad_delay[link.src])

    return simulate_step(make_schedule(schedule, S, M), lambda a: float(times.get(a.kind, (0.0,) * S)[a.stage]),
                         delay=lag)
