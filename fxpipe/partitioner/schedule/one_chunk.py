"""Schedules with one stage per rank: GPipe, 1F1B and zero-bubble ZB-H1.

Rank i runs stage i. Orders for 4 microbatches on 3 stages (``W`` is the split-off
weight gradient, Note [split backward] in ``actions``)::

    GPipe   stage i: F0 F1 F2 F3 B0 B1 B2 B3
    1F1B    stage 0: F0 F1 F2 B0 F3 B1 B2 B3                   (S - 1 - i warm-up forwards)
            stage 1: F0 F1 B0 F2 B1 F3 B2 B3
            stage 2: F0 B0 F1 B1 F2 B2 F3 B3
    ZB-H1   stage 0: F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3       (1F1B order; stage i keeps
            stage 1: F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3        i weight gradients pending
            stage 2: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3        and runs them last)

ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward chain that
travels up the pipeline carries only input gradients, and each later stage fills the
idle tail at the end of the step with its deferred weight gradients. It holds at most
S microbatches' activations on any stage, the same peak as 1F1B's first stage; with
equal F, B and W times its bubble is about a third of 1F1B's.
"""

from __future__ import annotations

from fxpipe.errors import ScheduleError

__all__ = ["stage_order", "ONE_CHUNK_ORDERS"]

ONE_CHUNK_ORDERS = ("gpipe", "1f1b", "zb-h1")


def stage_order(
    schedule: str, num_stages: int, microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """The (kind, microbatch) sequence that ``stage`` runs under ``schedule`` (one of the above)."""
    M = microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if schedule not in ONE_CHUNK_ORDERS:
        raise ScheduleError(
            f"unknown one-stage-per-rank schedule {schedule!r}; expected one of {list(ONE_CHUNK_ORDERS)}"
        )
    deferred = stage if schedule == "zb-h1" else None  # W's this stage keeps pending
    warmup = min(num_stages - 1 - stage, M)
    order = [("F", m) for m in range(warmup)]
    next_w = 0

    def backward(b: int) -> None:
        nonlocal next_w
        order.append(("B", b))
        if deferred is not None and b + 1 - next_w > deferred:
            order.append(("W", next_w))
            next_w += 1

    f, b = warmup, 0
    while f < M:
        order.append(("F", f))
        backward(b)
        f, b = f + 1, b + 1
    for m in range(b, M):
        backward(m)
    if deferred is not None:
        order += [("W", m) for m in range(next_w, M)]
    return order
