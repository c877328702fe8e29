"""Schedule validator: checks a ``Schedule`` before any process runs it, and prints it as a grid.

Checks, in order: every action names a stage its rank holds; each stage runs ``F`` and
``B`` exactly once per microbatch, and ``W`` at most once, after its ``B`` on the same
rank (Note [split backward] in ``actions``); forward before backward; matched sends and
receives (the messages on each producer -> consumer link are sent in the order they are
received); ascending microbatch order per stage and kind; and no deadlock when run the
way the executor runs it (``simulate_step`` with unit times, Note [step simulation]). A
failure raises ``ScheduleError`` with a step x rank grid that marks the failing step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fxpipe.errors import ScheduleError
from fxpipe.partitioner.schedule.actions import Action, ActionKind, Schedule
from fxpipe.partitioner.schedule.simulator import (
    Link,
    SimulationStuck,
    chain_links,
    dependencies,
    link_index,
    simulate_step,
)

__all__ = ["format_grid", "simulate", "validate_schedule", "max_in_flight"]

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def format_grid(
    rows: Sequence[Sequence[Action | None]],
    mark_step: int | None = None,
    mark_rank: int | None = None,
) -> str:
    """A step x rank table; ``>>`` marks ``mark_step`` and ``!`` the failing cell."""
    num_ranks = max((len(r) for r in rows), default=0)
    width = 6
    head = "     step | " + " | ".join(f"rank {r}".ljust(width) for r in range(num_ranks))
    lines = [head, "-" * len(head)]
    for step, row in enumerate(rows):
        cells = []
        for r in range(num_ranks):
            a = row[r] if r < len(row) else None
            text = str(a) if a is not None else "."
            if step == mark_step and r == mark_rank:
                text += " !"
            cells.append(text.ljust(width))
        prefix = ">>" if step == mark_step else "  "
        lines.append(f"{prefix} {step:6d} | " + " | ".join(cells))
    return "\n".join(lines)


def _list_grid(schedule: Schedule) -> list[list[Action | None]]:
    """The action lists side by side, by position (not simulated time)."""
    n = max((len(a) for a in schedule.actions), default=0)
    return [[acts[i] if i < len(acts) else None for acts in schedule.actions] for i in range(n)]


def _fail(schedule: Schedule, message: str, rank: int, index: int) -> ScheduleError:
    grid = format_grid(_list_grid(schedule), index, rank)
    return ScheduleError(
        f"schedule {schedule.name!r}: {message} (rank {rank}, position {index})\n"
        f"action lists (position × rank):\n{grid}"
    )


def _rows(schedule: Schedule, done: dict[Action, float]) -> list[list[Action | None]]:
    """Unit-step timeline rows of the actions that finished (an action of step t ends at t + 1)."""
    rank_of = {a: r for r, acts in enumerate(schedule.actions) for a in acts}
    steps = int(max(done.values(), default=0.0))
    rows: list[list[Action | None]] = [[None] * schedule.num_ranks for _ in range(steps)]
    for a, end in done.items():
        rows[int(end) - 1][rank_of[a]] = a
    return rows


def _deadlock(schedule: Schedule, links: Sequence[Link], stuck: SimulationStuck) -> ScheduleError:
    """Follow "waits for" from rank to rank until a rank repeats: that is the cycle to report."""
    producers, consumers = link_index(links)
    split = schedule.split_backward()
    done = stuck.done
    waiting = {
        r: acts[stuck.positions[r]]
        for r, acts in enumerate(schedule.actions)
        if stuck.positions[r] < len(acts)
    }

    def missing(a: Action) -> list[Action]:
        return [
            d
            for d, _ in dependencies(a, producers, consumers, (a.stage, a.microbatch) in split)
            if d not in done
        ]

    rows = _rows(schedule, done)
    grid_rows = rows + [[waiting.get(r) for r in range(schedule.num_ranks)]]
    chain: list[int] = []
    r = min(waiting)
    while r not in chain:
        chain.append(r)
        r = schedule.stage_ranks[missing(waiting[r])[0].stage]
        if r not in waiting:  # the sender has finished its list without sending
            break
    cycle = chain[chain.index(r) :] if r in chain else chain
    why = "; ".join(
        f"rank {q} waits in {waiting[q]} for " + ", ".join(str(d) for d in missing(waiting[q]))
        for q in cycle
    )
    return ScheduleError(
        f"schedule {schedule.name!r} deadlocks at step {len(rows)}: no rank can run its next action; {why}. "
        f"Reorder the actions so every receive's sender runs first.\nsimulated timeline (step × rank):\n"
        + format_grid(grid_rows, len(rows), cycle[0])
    )


def simulate(schedule: Schedule, links: Iterable[Link] | None = None) -> list[list[Action | None]]:
    """Run the lists with every action taking one step (Note [step simulation]): each step,
    every rank whose next action's inputs were produced in an earlier step runs it.
    Returns the step x rank timeline; ``ScheduleError`` on a deadlock, marking the step
    where nothing could run."""
    links = tuple(chain_links(schedule.num_stages) if links is None else links)
    try:
        line = simulate_step(schedule, lambda a: 1.0, links=links)
    except SimulationStuck as stuck:
        raise _deadlock(schedule, links, stuck) from None
    rows: list[list[Action | None]] = [
        [None] * schedule.num_ranks for _ in range(int(line.step_ms))
    ]
    for op in line.ops:
        rows[int(op.start_ms)][op.rank] = Action(op.stage, ActionKind(op.kind), op.microbatch)
    return rows


def validate_schedule(
    schedule: Schedule, links: Iterable[Link] | None = None
) -> list[list[Action | None]]:
    """Check ``schedule`` (see the module docstring); return its simulated timeline."""
    links = tuple(chain_links(schedule.num_stages) if links is None else links)
    S, M = schedule.num_stages, schedule.num_microbatches
    seen: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.stage >= S or a.microbatch >= M:
                raise _fail(schedule, f"{a} is out of range ({S} stages, {M} microbatches)", r, i)
            if schedule.stage_ranks[a.stage] != r:
                raise _fail(
                    schedule,
                    f"{a} runs on rank {r} but stage {a.stage} lives on rank "
                    f"{schedule.stage_ranks[a.stage]}",
                    r,
                    i,
                )
            if a in seen:
                raise _fail(schedule, f"{a} appears twice (first at position {seen[a][1]})", r, i)
            seen[a] = (r, i)
    for s in range(S):
        for m in range(M):
            for k in (F, B):
                if Action(s, k, m) not in seen:
                    r = schedule.stage_ranks[s]
                    raise _fail(
                        schedule,
                        f"{Action(s, k, m)} is missing: every stage needs F and B for every "
                        f"microbatch (and W where the backward is split)",
                        r,
                        len(schedule.actions[r]),
                    )
    for a, (r, i) in seen.items():
        if a.kind is not F and seen[Action(a.stage, F, a.microbatch)][1] > i:
            raise _fail(
                schedule, f"{a} runs before its forward {Action(a.stage, F, a.microbatch)}", r, i
            )
        if a.kind is W and seen[Action(a.stage, B, a.microbatch)][1] > i:
            raise _fail(
                schedule, f"{a} runs before its backward {Action(a.stage, B, a.microbatch)}", r, i
            )
    for ln in links:
        for kind, sender, receiver in ((F, ln.src, ln.dst), (B, ln.dst, ln.src)):
            if kind is B and not ln.grad:
                continue
            sent = [
                a.microbatch
                for a in schedule.actions[schedule.stage_ranks[sender]]
                if a.stage == sender and a.kind is kind
            ]
            recv = [
                a.microbatch
                for a in schedule.actions[schedule.stage_ranks[receiver]]
                if a.stage == receiver and a.kind is kind
            ]
            if sent != recv:
                j = next(j for j, (x, y) in enumerate(zip(sent, recv)) if x != y)
                bad = Action(receiver, kind, recv[j])
                what = "activations" if kind is F else "gradients"
                r, i = seen[bad]
                raise _fail(
                    schedule,
                    f"unmatched send/receive: stage {sender} sends {what} to stage {receiver} for "
                    f"microbatches {sent} but {receiver} receives them in order {recv}",
                    r,
                    i,
                )
    for r, acts in enumerate(schedule.actions):
        last: dict[tuple[int, ActionKind], int] = {}
        for i, a in enumerate(acts):
            key = (a.stage, a.kind)
            if key in last and a.microbatch < last[key]:
                raise _fail(
                    schedule,
                    f"{a} comes after microbatch {last[key]}: microbatches must run in "
                    f"ascending order per stage",
                    r,
                    i,
                )
            last[key] = a.microbatch
    return simulate(schedule, links)


def max_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most microbatches whose activations it holds at once: forwarded and not
    yet through their last backward action (``W`` where the backward is split, else ``B``)."""
    from fxpipe.partitioner.schedule.occupancy import in_flight_per_stage

    return list(in_flight_per_stage(schedule))
