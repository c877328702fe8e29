"""Note [processor sharing]: the step simulation when ranks share fewer cores than there are ranks."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fxpipe.errors import PartitionError, ScheduleError
from fxpipe.partitioner.schedule import ActionKind, Schedule, make_schedule, simulate_step
from fxpipe.partitioner.schedule.sharing import run_shared
from fxpipe.partitioner.schedule.simulator import prepare_ranks

F = ActionKind.FORWARD
CHUNKED = {"interleaved-1f1b", "zbv", "dualpipev"}
NAMES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev")


def _schedule(name: str, ranks: int, microbatches: int) -> Schedule:
    try:
        return make_schedule(name, ranks, microbatches, 2 if name in CHUNKED else 1)
    except ScheduleError:  # a count the schedule refuses (interleaved rounds)
        assume(False)
        raise


def _durations(seed: int):
    import random

    rnd, memo = random.Random(seed), {}
    return lambda a: memo.setdefault(a, rnd.uniform(0.2, 3.0))


def test_two_ranks_on_one_core_by_hand() -> None:
    # F = 1, B = 2: F0 on rank 0 alone [0, 1]; F1 (rank 0) and F0 (rank 1) share the core [1, 3]; F1 of
    # rank 1 alone [3, 4]; B0 of rank 1 [4, 6]; B0 of rank 0 and B1 of rank 1 share [6, 10]; B1 of rank 0 [10, 12]
    line = simulate_step(
        make_schedule("gpipe", 2, 2), lambda a: 1.0 if a.kind is F else 2.0, cores=1
    )
    ends = {(op.rank, op.kind, op.microbatch): op.end_ms for op in line.ops}
    assert ends[(0, "F", 1)] == pytest.approx(3.0) and ends[(1, "F", 0)] == pytest.approx(3.0)
    assert line.step_ms == pytest.approx(12.0)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(NAMES),
    st.integers(2, 4),
    st.integers(1, 6),
    st.integers(0, 10**6),
    st.lists(st.sampled_from([0.0, 0.4, 2.5]), min_size=4, max_size=4),
)
def test_enough_cores_is_the_plain_simulation(
    name: str, ranks: int, microbatches: int, seed: int, prologue: list[float]
) -> None:
    schedule = _schedule(name, ranks, microbatches)
    plain = simulate_step(
        schedule, _durations(seed), delay=lambda ln, k: 0.3, prologue=prologue[:ranks]
    )
    shared = run_shared(
        schedule,
        prepare_ranks(
            schedule, _durations(seed), delay=lambda ln, k: 0.3, prologue=prologue[:ranks]
        ),
        cores=ranks,
    )
    for r in range(ranks):  # a rank's first action starts after its prologue
        assert min(op.start_ms for op in plain.ops if op.rank == r) >= prologue[r] - 1e-9
    assert sorted((op.rank, str(op), round(op.end_ms, 9)) for op in shared.ops) == sorted(
        (op.rank, str(op), round(op.end_ms, 9)) for op in plain.ops
    )


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(NAMES),
    st.integers(2, 4),
    st.integers(1, 6),
    st.integers(0, 10**6),
    st.floats(0.5, 1.0),
)
def test_fewer_cores_stretch_the_step_at_most_by_ranks_over_cores(
    name: str, ranks: int, microbatches: int, seed: int, share: float
) -> None:
    schedule = _schedule(name, ranks, microbatches)
    cores = max(1.0, share * ranks)
    work = _durations(seed)
    plain = simulate_step(schedule, work, delay=lambda ln, k: 0.3)
    shared = simulate_step(schedule, work, delay=lambda ln, k: 0.3, cores=cores)
    assert plain.step_ms - 1e-9 <= shared.step_ms <= plain.step_ms * ranks / cores + 1e-9
    actions = {(a.stage, a.microbatch, a.kind.value): a for acts in schedule.actions for a in acts}
    for op in shared.ops:  # every action does all its work, at most at full speed
        assert op.end_ms - op.start_ms >= work(actions[(op.stage, op.microbatch, op.kind)]) - 1e-9


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(NAMES),
    st.integers(2, 4),
    st.integers(1, 6),
    st.integers(0, 10**6),
    st.lists(st.floats(0.0, 2.0), min_size=4, max_size=4),
)
def test_one_core_without_delays_runs_all_the_work_back_to_back(
    name: str, ranks: int, microbatches: int, seed: int, prologue: list[float]
) -> None:
    schedule = _schedule(name, ranks, microbatches)
    work = _durations(seed)
    line = simulate_step(schedule, work, cores=1, prologue=prologue[:ranks])
    assert line.step_ms == pytest.approx(
        sum(work(a) for acts in schedule.actions for a in acts) + sum(prologue[:ranks])
    )


def test_oversubscribed_cores_do_less_work_only_while_actions_outnumber_them() -> None:
    # the hand example above at rate 0.8: alone an action runs at full speed; two actions on one core
    # progress at 0.4 each. F1 (rank 0) and F0 (rank 1) share [1, 1 + 1 / 0.4]; F1 of rank 1 alone
    # [3.5, 4.5]; B0 of rank 1 [4.5, 6.5]; B0 of rank 0 and B1 of rank 1 share [6.5, 6.5 + 2 / 0.4]; B1 [11.5, 13.5]
    line = simulate_step(
        make_schedule("gpipe", 2, 2),
        lambda a: 1.0 if a.kind is F else 2.0,
        cores=1,
        oversubscribed_rate=0.8,
    )
    ends = {(op.rank, op.kind, op.microbatch): op.end_ms for op in line.ops}
    assert ends[(0, "F", 0)] == pytest.approx(1.0) and ends[(1, "F", 0)] == pytest.approx(3.5)
    assert line.step_ms == pytest.approx(13.5)
    schedule = make_schedule("1f1b", 2, 4)
    enough = simulate_step(schedule, _durations(7), cores=2, oversubscribed_rate=0.5)
    assert enough.step_ms == pytest.approx(
        simulate_step(schedule, _durations(7)).step_ms
    )  # never outnumbered
    with pytest.raises(PartitionError, match="oversubscribed_rate"):
        simulate_step(schedule, _durations(7), cores=1, oversubscribed_rate=0.0)


def test_cores_must_be_positive() -> None:
    with pytest.raises(PartitionError, match="cores"):
        simulate_step(make_schedule("1f1b", 2, 2), lambda a: 1.0, cores=0)


def test_an_action_that_starts_on_busy_cores_first_waits_its_stall_by_hand() -> None:
    # Note [message stalls]: GPipe, 2 ranks on 2 cores, F = 1, B = 2, every action's stall 0.5. F0 of rank 0
    # starts alone [0, 1]. At 1, F1 (rank 0) and F0 (rank 1) start together: both cores busy, so the first
    # waits 0.5 x 2 / 2 [1, 2.5] and the second runs [1, 2]. F1 of rank 1 alone [2.5, 3.5], B0 of rank 1 alone
    # [3.5, 5.5]; at 5.5 B1 (rank 1) waits 0.5 [5.5, 8] while B0 (rank 0) runs [5.5, 7.5]; B1 of rank 0 [8, 10].
    schedule = make_schedule("gpipe", 2, 2)
    work = lambda a: 1.0 if a.kind is F else 2.0  # noqa: E731
    line = simulate_step(schedule, work, stall=lambda a: 0.5)
    spans = {(op.rank, op.kind, op.microbatch): (op.start_ms, op.end_ms) for op in line.ops}
    assert spans[(0, "F", 1)] == pytest.approx((1.0, 2.5)) and spans[(1, "F", 0)] == pytest.approx(
        (1.0, 2.0)
    )
    assert spans[(1, "B", 1)] == pytest.approx((5.5, 8.0)) and spans[(0, "B", 0)] == pytest.approx(
        (5.5, 7.5)
    )
    assert line.step_ms == pytest.approx(10.0) and simulate_step(
        schedule, work
    ).step_ms == pytest.approx(9.0)
    # one microbatch: no two actions ever run at once, so nothing stalls
    one = make_schedule("gpipe", 2, 1)
    assert simulate_step(one, work, stall=lambda a: 0.5).step_ms == pytest.approx(
        simulate_step(one, work).step_ms
    )
    # on one core an action alone keeps it busy: each of the four waits 0.5 (6 + 4 x 0.5)
    assert simulate_step(one, work, cores=1, stall=lambda a: 0.5).step_ms == pytest.approx(8.0)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(NAMES),
    st.integers(2, 4),
    st.integers(1, 6),
    st.integers(0, 10**6),
    st.floats(0.0, 1.0),
)
def test_stalls_delay_the_step_by_at_most_all_of_them(
    name: str, ranks: int, microbatches: int, seed: int, wait: float
) -> None:
    schedule = _schedule(name, ranks, microbatches)
    work = _durations(seed)
    plain = simulate_step(schedule, work, delay=lambda ln, k: 0.3)
    stalled = simulate_step(schedule, work, delay=lambda ln, k: 0.3, stall=lambda a: wait)
    actions = [a for acts in schedule.actions for a in acts]
    assert plain.step_ms - 1e-9 <= stalled.step_ms <= plain.step_ms + wait * len(actions) + 1e-9
    by_key = {(a.stage, a.microbatch, a.kind.value): a for a in actions}
    for op in stalled.ops:  # an action runs its whole work, plus at most its one wait
        assert (
            work(by_key[(op.stage, op.microbatch, op.kind)]) - 1e-9
            <= op.end_ms - op.start_ms
            <= work(by_key[(op.stage, op.microbatch, op.kind)]) + wait + 1e-9
        )


def test_a_prologue_takes_a_core_and_delays_its_rank_by_hand() -> None:
    # GPipe, 2 ranks on 2 cores, one microbatch, F = 1, B = 2, stalls 0.5; rank 1 first posts for 2 (its
    # prologue). At 0 its prologue runs, so F of rank 0 starts on busy cores and waits 0.5 x 2 / 2 [0, 1.5];
    # rank 1's F waits for its prologue, not for F of rank 0 [2, 3]; then B of rank 1 [3, 5], of rank 0 [5, 7]
    schedule = make_schedule("gpipe", 2, 1)
    work = lambda a: 1.0 if a.kind is F else 2.0  # noqa: E731
    line = simulate_step(schedule, work, stall=lambda a: 0.5, prologue=(0.0, 2.0))
    spans = {(op.rank, op.kind): (op.start_ms, op.end_ms) for op in line.ops}
    assert spans[(0, "F")] == pytest.approx((0.0, 1.5)) and spans[(1, "F")] == pytest.approx(
        (2.0, 3.0)
    )
    assert line.step_ms == pytest.approx(7.0) and simulate_step(
        schedule, work, prologue=(0.0, 2.0)
    ).step_ms == pytest.approx(7.0)
    with pytest.raises(PartitionError, match="prologue"):
        simulate_step(schedule, work, prologue=(0.0, -1.0))
