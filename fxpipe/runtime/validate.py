"""Schedule validator: checks a ``Schedule`` before any process runs it.

Checks, in order: every action names a stage its rank holds; each stage runs ``F`` and
``B`` exactly once per microbatch; forward before backward; matched sends and
receives (the messages on each producer→consumer link are sent in the order they are
received); ascending microbatch order per stage; and no deadlock when simulated with
non-blocking sends and blocking receives, the way the executor runs. A failure raises
``ScheduleError`` with a step × rank grid that marks the failing step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fxpipe.errors import ScheduleError
from fxpipe.runtime.schedule import Action, ActionKind, Schedule

__all__ = ["ScheduleError", "Link", "chain_links", "simulate", "format_grid", "validate_schedule", "max_in_flight"]

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


def format_grid(rows: Sequence[Sequence[Action | None]], mark_step: int | None = None,
                mark_rank: int | None = None) -> str:
    """A step × rank table; ``>>`` marks ``mark_step`` and ``!`` the failing cell."""
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
    return ScheduleError(f"schedule {schedule.name!r}: {message} (rank {rank}, position {index})\n"
                         f"action lists (position × rank):\n{grid}")


def _dependencies(action: Action, links: Sequence[Link], has_weight: bool) -> list[Action]:
    """Actions (on any rank) that must finish before ``action`` can start."""
    s, m = action.stage, action.microbatch
    if action.kind is F:
        return [Action(ln.src, F, m) for ln in links if ln.dst == s]
    if action.kind is B:
        return [Action(s, F, m)] + [Action(ln.dst, B, m) for ln in links if ln.src == s and ln.grad]
    return [Action(s, B, m)] if has_weight else []


def _deadlock(schedule: Schedule, links: Sequence[Link], has_weight: bool, done: set[Action],
              pos: list[int], rows: list[list[Action | None]]) -> ScheduleError:
    """Follow "waits for" from rank to rank until a rank repeats: that is the cycle to report."""
    waiting = {r: acts[pos[r]] for r, acts in enumerate(schedule.actions) if pos[r] < len(acts)}
    stuck = [row[:] for row in rows] + [[waiting.get(r) for r in range(schedule.num_ranks)]]
    chain: list[int] = []
    r = min(waiting)
    while r not in chain:
        chain.append(r)
        missing = next(d for d in _dependencies(waiting[r], links, has_weight) if d not in done)
        r = schedule.stage_ranks[missing.stage]
        if r not in waiting:  # the sender has finished its list without sending
            break
    cycle = chain[chain.index(r):] if r in chain else chain
    why = "; ".join(
        f"rank {q} waits in {waiting[q]} for "
        + ", ".join(str(d) for d in _dependencies(waiting[q], links, has_weight) if d not in done)
        for q in cycle)
    return ScheduleError(
        f"schedule {schedule.name!r} deadlocks at step {len(rows)}: no rank can run its next action; {why}. "
        f"Reorder the actions so every receive's sender runs first.\nsimulated timeline (step × rank):\n"
        + format_grid(stuck, len(rows), cycle[0]))


def simulate(schedule: Schedule, links: Iterable[Link] | None = None) -> list[list[Action | None]]:
    """Run the lists in lock-step: each step, every rank whose next action's inputs
    were produced in an earlier step runs it. Returns the step × rank timeline.

    Raises ``ScheduleError`` on a deadlock, marking the step where nothing could run.
    """
    links = tuple(chain_links(schedule.num_stages) if links is None else links)
    has_weight = any(a.kind is W for acts in schedule.actions for a in acts)
    done: set[Action] = set()
    pos = [0] * schedule.num_ranks
    rows: list[list[Action | None]] = []
    while any(p < len(acts) for p, acts in zip(pos, schedule.actions)):
        row: list[Action | None] = [None] * schedule.num_ranks
        for r, acts in enumerate(schedule.actions):
            if pos[r] < len(acts) and all(d in done for d in _dependencies(acts[pos[r]], links, has_weight)):
                row[r] = acts[pos[r]]
        if not any(row):
            raise _deadlock(schedule, links, has_weight, done, pos, rows)
        for r, a in enumerate(row):
            if a is not None:
                done.add(a)
                pos[r] += 1
        rows.append(row)
    return rows


def validate_schedule(schedule: Schedule, links: Iterable[Link] | None = None) -> list[list[Action | None]]:
    """Check ``schedule`` (see the module docstring); return its simulated timeline."""
    links = tuple(chain_links(schedule.num_stages) if links is None else links)
    S, M = schedule.num_stages, schedule.num_microbatches
    seen: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.stage >= S or a.microbatch >= M:
                raise _fail(schedule, f"{a} is out of range ({S} stages, {M} microbatches)", r, i)
            if schedule.stage_ranks[a.stage] != r:
                raise _fail(schedule, f"{a} runs on rank {r} but stage {a.stage} lives on rank "
                                      f"{schedule.stage_ranks[a.stage]}", r, i)
            if a in seen:
                raise _fail(schedule, f"{a} appears twice (first at position {seen[a][1]})", r, i)
            seen[a] = (r, i)
    has_weight = any(a.kind is W for a in seen)
    kinds = (F, B, W) if has_weight else (F, B)
    for s in range(S):
        for m in range(M):
            for k in kinds:
                if Action(s, k, m) not in seen:
                    r = schedule.stage_ranks[s]
                    raise _fail(schedule, f"{Action(s, k, m)} is missing: every stage needs {'/'.join(x.value for x in kinds)} "
                                          f"for every microbatch", r, len(schedule.actions[r]))
    for a, (r, i) in seen.items():
        if a.kind is not F and seen[Action(a.stage, F, a.microbatch)][1] > i:
            raise _fail(schedule, f"{a} runs before its forward {Action(a.stage, F, a.microbatch)}", r, i)
        if a.kind is W and seen[Action(a.stage, B, a.microbatch)][1] > i:
            raise _fail(schedule, f"{a} runs before its backward {Action(a.stage, B, a.microbatch)}", r, i)
    for ln in links:
        for kind, sender, receiver in ((F, ln.src, ln.dst), (B, ln.dst, ln.src)):
            if kind is B and not ln.grad:
                continue
            sent = [a.microbatch for a in schedule.actions[schedule.stage_ranks[sender]] if a.stage == sender and a.kind is kind]
            recv_kind = F if kind is F else B
            recv = [a.microbatch for a in schedule.actions[schedule.stage_ranks[receiver]]
                    if a.stage == receiver and a.kind is recv_kind]
            if sent != recv:
                j = next(j for j, (x, y) in enumerate(zip(sent, recv)) if x != y)
                bad = Action(receiver, recv_kind, recv[j])
                what = "activations" if kind is F else "gradients"
                r, i = seen[bad]
                raise _fail(schedule, f"unmatched send/receive: stage {sender} sends {what} to stage {receiver} for "
                                      f"microbatches {sent} but {receiver} receives them in order {recv}", r, i)
    for r, acts in enumerate(schedule.actions):
        last: dict[tuple[int, ActionKind], int] = {}
        for i, a in enumerate(acts):
            key = (a.stage, a.kind)
            if key in last and a.microbatch < last[key]:
                raise _fail(schedule, f"{a} comes after microbatch {last[key]}: microbatches must run in "
                                      f"ascending order per stage", r, i)
            last[key] = a.microbatch
    return simulate(schedule, links)


def max_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most microbatches forwarded but not yet backwarded at any time."""
    peak = [0] * schedule.num_stages
    for acts in schedule.actions:
        live: dict[int, int] = {}
        for a in acts:
            if a.kind is F:
                live[a.stage] = live.get(a.stage, 0) + 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is B:
                live[a.stage] -= 1
    return peak
