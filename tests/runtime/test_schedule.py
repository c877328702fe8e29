"""Schedules and the validator, without processes."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.errors import ConfigError
from fxpipe.runtime import (
    Action,
    ActionKind,
    Link,
    ScheduleError,
    gpipe,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    simulate,
    validate_schedule,
)

SIZES = [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (5, 3)]


def _edit(schedule, rank, acts):
    actions = list(schedule.actions)
    actions[rank] = tuple(Action.parse(a) for a in acts.split())
    return dataclasses.replace(schedule, actions=tuple(actions))


def test_action_prints_and_parses() -> None:
    a = Action(1, ActionKind.FORWARD, 0)
    assert str(a) == "1F0" and str(Action(0, "B", 3)) == "0B3"
    assert Action.parse("12B30") == Action(12, ActionKind.BACKWARD, 30)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("1X0")


@pytest.mark.parametrize("stages,mbs", SIZES)
@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
def test_builtin_schedules_are_valid(fn, stages: int, mbs: int) -> None:
    s = fn(stages, mbs)
    timeline = validate_schedule(s)
    assert sum(a is not None for row in timeline for a in row) == 2 * stages * mbs


def test_gpipe_literal_lists() -> None:
    assert [" ".join(map(str, acts)) for acts in gpipe(2, 2).actions] == [
        "0F0 0F1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
    ]


def test_1f1b_literal_lists() -> None:
    assert [" ".join(map(str, acts)) for acts in one_f_one_b(3, 4).actions] == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


@pytest.mark.parametrize("stages,mbs", [(2, 8), (4, 8), (4, 2), (6, 12)])
def test_1f1b_bounds_in_flight_microbatches(stages: int, mbs: int) -> None:
    assert max_in_flight(one_f_one_b(stages, mbs)) == [min(stages - i, mbs) for i in range(stages)]
    assert max_in_flight(gpipe(stages, mbs)) == [mbs] * stages


def test_1f1b_is_no_longer_than_gpipe() -> None:
    assert len(simulate(one_f_one_b(4, 8))) == len(simulate(gpipe(4, 8))) == 2 * (8 + 4 - 1)


def test_validator_catches_backward_before_forward() -> None:
    bad = _edit(one_f_one_b(3, 4), 2, "2B0 2F0 2F1 2B1 2F2 2B2 2F3 2B3")
    with pytest.raises(ScheduleError, match="2B0 runs before its forward 2F0") as err:
        validate_schedule(bad)
    assert ">>      0 |" in str(err.value) and "2B0 !" in str(err.value)


def test_validator_catches_missing_and_duplicate_actions() -> None:
    with pytest.raises(ScheduleError, match="1B1 is missing"):
        validate_schedule(_edit(gpipe(2, 2), 1, "1F0 1F1 1B0"))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate_schedule(_edit(gpipe(2, 2), 1, "1F0 1F1 1B0 1B1 1B1"))


def test_validator_catches_wrong_rank() -> None:
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate_schedule(_edit(gpipe(2, 1), 0, "0F0 1F0 0B0"))


def test_validator_catches_unmatched_sends() -> None:
    bad = _edit(gpipe(2, 2), 1, "1F1 1F0 1B0 1B1")
    with pytest.raises(
        ScheduleError,
        match=r"unmatched send/receive: stage 0 sends activations to stage 1 "
        r"for microbatches \[0, 1\] but 1 receives them in order \[1, 0\]",
    ):
        validate_schedule(bad)


def test_validator_catches_descending_microbatches_on_a_leaf_link() -> None:
    # stage 1 has no consumer, so only the order check can see its backwards out of order
    bad = _edit(gpipe(2, 2), 1, "1F0 1F1 1B1 1B0")
    with pytest.raises(ScheduleError, match="unmatched send/receive: stage 1 sends gradients"):
        validate_schedule(bad)


def test_validator_catches_deadlock_and_marks_the_step() -> None:
    s = one_f_one_b(3, 4)
    # rank 1 waits for 2B0 before sending 1F1; rank 2 waits for 1F1 before running 2B0
    bad = _edit(
        _edit(s, 1, "1F0 1B0 1F1 1F2 1B1 1F3 1B2 1B3"), 2, "2F0 2F1 2B0 2B1 2F2 2B2 2F3 2B3"
    )
    with pytest.raises(ScheduleError, match="deadlocks at step 3") as err:
        validate_schedule(bad)
    text = str(err.value)
    assert ">>      3 |" in text and "1B0 !" in text and "waits in 1B0 for 2B0" in text


def test_skip_links_add_dependencies() -> None:
    # stage 2 reads stage 0 directly: with the skip link, 2F0 depends on 0F0 as well
    links = (Link(0, 1), Link(1, 2), Link(0, 2))
    timeline = validate_schedule(one_f_one_b(3, 2), links)
    assert timeline[0][0] == Action(0, ActionKind.FORWARD, 0)
    no_grad = validate_schedule(gpipe(2, 2), (Link(0, 1, grad=False),))
    assert no_grad[2][0] == Action(0, ActionKind.BACKWARD, 0)  # no wait for 1B0's gradient


def test_make_schedule_refuses_unknown_names() -> None:
    assert make_schedule("GPipe", 2, 2) == gpipe(2, 2)
    with pytest.raises(
        ConfigError,
        match=r"unknown schedule 'zb'.*\['gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1', "
        r"'zbv', 'dualpipev'\]",
    ):
        make_schedule("zb", 2, 2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_runtime_order_is_the_planner_simulated_order(name: str) -> None:
    from fxpipe.partitioner.schedule import stage_order

    for S, M in [(1, 1), (3, 2), (4, 8), (5, 3)]:
        sched = make_schedule(name, S, M)
        for s in range(S):
            assert [(a.kind.value, a.microbatch) for a in sched.rank_actions(s)] == stage_order(
                name, S, M, s
            )
