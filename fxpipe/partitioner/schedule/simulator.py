"""The discrete-event simulator of one pipeline step: per-rank action lists, action times, link delays.

Note [step simulation]: every rank runs its action list in order, one action at a time.
An action starts when its rank is free and its inputs have arrived:

* ``F(s, m)`` needs ``F(p, m)`` of every producer p of stage s, plus the delay of the
  activation message on that link;
* ``B(s, m)`` needs ``F(s, m)`` and ``B(c, m)`` of every consumer c whose link carries
  gradients, plus that gradient message's delay (the last stage's ``B`` only needs its
  own ``F``: the loss);
* ``W(s, m)`` needs ``B(s, m)`` (Note [split backward] in ``actions``).

A rank may first do work of its own when the step starts (its ``prologue``: on gloo,
posting every receive of the step), before its first action can start whatever its
inputs. That is how the runtime executes a schedule (non-blocking sends, receives waited for
right before the computation that needs them), so a schedule the simulator finishes is
deadlock-free, and one it cannot finish deadlocks (``SimulationStuck``). With every
action lasting 1 and no delays it is the unit-step simulation the validator prints; with
the cost model's times it is the planner's predicted step (``prediction.predict``), the
report's timeline, and the cluster search's inner loop. Messages are delays on their
link, not busy time of either rank (the runtime overlaps them with compute).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from fxpipe.errors import PartitionError
from fxpipe.partitioner.schedule.actions import Action, ActionKind, Schedule
from fxpipe.partitioner.schedule.sharing import run_shared
from fxpipe.partitioner.schedule.timeline import (
    Link,
    PreparedRank,
    ScheduleOp,
    SimulationStuck,
    Timeline,
    chain_links,
    dependencies,
    link_index,
)

__all__ = [
    "Link",
    "chain_links",
    "link_index",
    "ScheduleOp",
    "Timeline",
    "SimulationStuck",
    "simulate_step",
    "dependencies",
    "prepare_ranks",
]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def simulate_step(
    schedule: Schedule,
    duration: Callable[[Action], float],
    *,
    links: Sequence[Link] | None = None,
    delay: Callable[[Link, ActionKind], float] | None = None,
    cores: float | None = None,
    oversubscribed_rate: float = 1.0,
    stall: Callable[[Action], float] | None = None,
    prologue: Sequence[float] = (),
) -> Timeline:
    """Start and end of every action of ``schedule`` (Note [step simulation]).

    ``duration(action)`` is its compute time; ``delay(link, F or B)`` the time an
    activation (``F``) or gradient (``B``) message spends on ``link`` (default 0);
    ``links`` default to a chain. ``cores``: the ranks share this many cores
    (Note [processor sharing] in ``sharing``, where ``oversubscribed_rate`` is the work a
    core does while more actions run than there are cores); default one core per rank.
    ``stall(action)``: the time the action waits, off the cores, before it runs when it
    starts while every core is busy (Note [message stalls] in ``sharing``). ``prologue[r]``:
    work rank r does when the step starts, whatever its inputs, before its first action can
    (posting the step's receives, Note [step prediction]); it is no action of the timeline,
    so ``Timeline.bubble`` counts it as idle. Raises ``SimulationStuck`` on a deadlock.

    >>> from fxpipe.partitioner.schedule.registry import make_schedule
    >>> simulate_step(make_schedule("gpipe", 2, 2), lambda a: 1.0 if a.kind is F else 2.0).step_ms
    9.0
    """
    ranks = prepare_ranks(
        schedule, duration, links=links, delay=delay, stall=stall, prologue=prologue
    )
    stalls = any(any(p.stalls) for p in ranks)
    if (cores is not None and cores < len(ranks)) or stalls:
        return run_shared(
            schedule, ranks, len(ranks) if cores is None else cores, oversubscribed_rate
        )
    return _run(schedule, ranks)


def prepare_ranks(
    schedule: Schedule,
    duration: Callable[[Action], float],
    *,
    links: Sequence[Link] | None = None,
    delay: Callable[[Link, ActionKind], float] | None = None,
    stall: Callable[[Action], float] | None = None,
    prologue: Sequence[float] = (),
) -> list[PreparedRank]:
    """Each rank's actions with their durations, what they wait for and their stalls, as
    ``simulate_step`` takes them (the plain and the processor-sharing runs share them)."""
    if len(prologue) > schedule.num_ranks or any(not p >= 0 for p in prologue):
        raise PartitionError(
            f"prologue must give at most {schedule.num_ranks} times >= 0, got {list(prologue)}"
        )
    links = tuple(chain_links(schedule.num_stages) if links is None else links)
    producers, consumers = link_index(links)
    split = schedule.split_backward()
    ranks: list[PreparedRank] = []
    for r, acts in enumerate(schedule.actions):
        prep = PreparedRank(prologue=float(prologue[r]) if r < len(prologue) else 0.0)
        for a in acts:
            deps = dependencies(a, producers, consumers, (a.stage, a.microbatch) in split)
            prep.actions.append(a)
            prep.durations.append(float(duration(a)))
            prep.waits.append(
                [
                    (d, delay(ln, d.kind) if delay is not None and ln is not None else 0.0)
                    for d, ln in deps
                ]
            )
            prep.stalls.append(float(stall(a)) if stall is not None else 0.0)
        ranks.append(prep)
    return ranks


def _run(schedule: Schedule, ranks: list[PreparedRank]) -> Timeline:
    end: dict[Action, float] = {}
    free = [prep.prologue for prep in ranks]
    pos = [0] * len(ranks)
    waiting: dict[Action, list[int]] = {}
    todo = deque(range(len(ranks)))
    ops: list[ScheduleOp] = []
    while todo:
        r = todo.popleft()
        prep = ranks[r]
        while pos[r] < len(prep.actions):
            i = pos[r]
            ready = free[r]
            missing = None
            for dep, lag in prep.waits[i]:
                t = end.get(dep)
                if t is None:
                    missing = dep
                    break
                ready = max(ready, t + lag)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            a = prep.actions[i]
            finish = ready + prep.durations[i]
            end[a] = free[r] = finish
            ops.append(ScheduleOp(a.stage, a.microbatch, a.kind.value, ready, finish, r))
            pos[r] += 1
            todo.extend(waiting.pop(a, ()))
    if any(p < len(prep.actions) for p, prep in zip(pos, ranks)):
        raise SimulationStuck(pos, end)
    ops.sort(key=lambda op: (op.start_ms, op.rank))
    return Timeline(
        schedule=schedule.name,
        microbatches=schedule.num_microbatches,
        ops=tuple(ops),
        num_ranks=schedule.num_ranks,
    )
