"""The step simulation when ranks share fewer cores than there are ranks (processor sharing).

Note [processor sharing]: with one core per rank (``cores=None``) every action runs at full
speed as soon as its rank is free and its inputs have arrived (Note [step simulation]).
On a host with fewer cores than busy ranks (4 ranks on 2 cores), the running actions
share the cores: at any moment each of the ``n`` running actions progresses at full
speed if ``n <= cores`` and at ``cores / n x oversubscribed_rate`` of it otherwise, and
a rank that waits for a message takes no core (gloo's receive sleeps), while a rank's
prologue (Note [step simulation]) takes its share like an action. The rate (1 by
default) is the work the cores lose while the actions outnumber them: the scheduler
switches between them every time slice and each switch refills the caches
(``RuntimeCosts.oversubscribed_rate``, calibrated per device). So the simulation advances
event by event (an action finishes, a message lands and its consumer becomes runnable),
recomputing the share whenever the set of running actions changes. With ``cores`` at
least the number of ranks it gives the same timeline as the plain simulation (tested);
with every rank busy all the time it is each action stretched by ``ranks / cores /
oversubscribed_rate``, the ``shared_cores`` bound of the prediction (Note [shared cores]
in ``fxpipe.partitioner.prediction``, ``RuntimeCosts.busy_speed``).

Note [message stalls]: an action's messages are posted by its rank's thread and moved by
gloo's transport thread, which needs a core of its own for a moment. While every core is
busy with an action it waits for the scheduler's next time slice (milliseconds), and so
does the call that posts, often enough to count: while the ranks compute all the time a
gloo call's mean cost is several times its median. A rank that waits for a message sleeps and
leaves its core, so a pipeline's messages stall only while its other ranks compute. An
action that starts while every core is busy (``n`` actions running with it, ``n >=
cores``) therefore first waits its ``stall`` (``RuntimeCosts.message_stall_ms`` per
message) times ``n / cores``, off the cores (the more threads a time slice is shared
among, the longer the wait); one that starts with a core free runs at once. The whole
step runs through this event-driven simulation whenever an action may stall, one core
per rank when no sharing is asked for. Gloo's send is a rendezvous: the data leaves from
the sending call itself only when the receiver's announcement of its receive reached the
sender first; otherwise the sender's transport thread sends it when the announcement
comes, and while the sender computes that thread first waits for a core, up to a time
slice; a receive posted well before its send is delivered without that wait. So the
runtime posts every receive of a step when the step starts (Note [posting messages] in
``fxpipe.runtime.pipeline.comm``), and ``message_stall_ms`` prices what is left.
"""

from __future__ import annotations

from fxpipe.errors import PartitionError
from fxpipe.partitioner.schedule.actions import Action, Schedule
from fxpipe.partitioner.schedule.timeline import PreparedRank, ScheduleOp, SimulationStuck, Timeline

__all__ = ["run_shared"]

_EPS = 1e-9  # ms


def run_shared(
    schedule: Schedule, ranks: list[PreparedRank], cores: float, oversubscribed_rate: float = 1.0
) -> Timeline:
    """Start and end of every prepared action when the ranks share ``cores`` cores (Note [processor sharing])."""
    if not cores > 0:
        raise PartitionError(f"cores must be > 0, got {cores}")
    if not 0 < oversubscribed_rate <= 1:
        raise PartitionError(f"oversubscribed_rate must be in (0, 1], got {oversubscribed_rate}")
    n = len(ranks)
    end: dict[Action, float] = {}
    pos = [0] * n
    start = [0.0] * n
    left: dict[int, float] = {}  # running rank -> work (ms at full speed) still to do
    ready_at: dict[
        int, float
    ] = {}  # rank whose next action's inputs are all sent -> when the last lands
    blocked: set[int] = set(
        range(n)
    )  # ranks whose next action still misses an input (re-checked on each finish)
    ops: list[ScheduleOp] = []
    stalled: set[int] = (
        set()
    )  # ranks whose next action has waited its stall (Note [message stalls])
    now = 0.0

    def check(r: int) -> None:
        prep = ranks[r]
        if pos[r] >= len(prep.actions):
            blocked.discard(r)
            return
        t = now
        for dep, lag in prep.waits[pos[r]]:
            done = end.get(dep)
            if done is None:
                blocked.add(r)
                return
            t = max(t, done + lag)
        blocked.discard(r)
        ready_at[r] = t

    posting = {
        r for r in range(n) if ranks[r].prologue > 0
    }  # ranks doing their prologue, no action yet
    for r in range(n):
        if r in posting:
            left[r] = ranks[r].prologue
        else:
            check(r)
    while left or ready_at:
        starting = [r for r, t in ready_at.items() if t <= now + _EPS]
        for r in starting:
            del ready_at[r]
            if r not in stalled:
                start[r] = now
            left[r] = ranks[r].durations[pos[r]]
        for r in starting:
            wait = ranks[r].stalls[pos[r]]
            if wait > 0 and r not in stalled and len(left) >= cores:
                busy = len(left)
                del left[r]
                ready_at[r] = now + wait * busy / cores
                stalled.add(r)
            else:
                stalled.discard(r)
        if not left:
            now = min(ready_at.values())
            continue
        speed = cores / len(left) * oversubscribed_rate if len(left) > cores else 1.0
        step = min(left.values()) / speed
        if ready_at:
            step = min(step, min(ready_at.values()) - now)
        now += step
        finished = []
        for r in left:
            left[r] -= step * speed
            if left[r] <= _EPS:
                finished.append(r)
        for r in finished:
            del left[r]
            if r in posting:
                posting.discard(r)
                continue
            a = ranks[r].actions[pos[r]]
            end[a] = now
            ops.append(ScheduleOp(a.stage, a.microbatch, a.kind.value, start[r], now, r))
            pos[r] += 1
        if finished:
            for r in finished + sorted(blocked):
                if r not in left and r not in ready_at:
                    check(r)
    if any(p < len(prep.actions) for p, prep in zip(pos, ranks)):
        raise SimulationStuck(pos, end)
    ops.sort(key=lambda op: (op.start_ms, op.rank))
    return Timeline(
        schedule=schedule.name,
        microbatches=schedule.num_microbatches,
        ops=tuple(ops),
        num_ranks=schedule.num_ranks,
    )
