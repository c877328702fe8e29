"""Schedules as data: every named schedule is valid, literal lists, placement, memory, bubbles, the validator."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.errors import ScheduleError
from fxpipe.partitioner.schedule import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Schedule,
    in_flight_per_stage,
    make_schedule,
    placement_of,
    placements_of,
    runnable_schedules,
    simulate_step,
    schedule_kind,
    stage_ranks,
    validate_schedule,
)

SIZES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 4), (3, 2), (3, 3), (3, 6), (4, 4), (4, 8), (5, 10)]


def _lists(s: Schedule) -> list[str]:
    return [" ".join(map(str, acts)) for acts in s.actions]


def _unit_times(s: Schedule) -> float:
    """Step length with F = B(input) = W = 1 per full stage (chunks take 1/V of it), B fused = 2."""
    split, v = s.split_backward(), s.virtual_stages

    def duration(a: Action) -> float:
        if a.kind is ActionKind.BACKWARD and (a.stage, a.microbatch) not in split:
            return 2.0 / v
        return 1.0 / v

    return simulate_step(s, duration).step_ms


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("ranks, microbatches", SIZES)
def test_every_schedule_is_valid_at_every_size(name: str, ranks: int, microbatches: int) -> None:
    try:
        s = make_schedule(name, ranks, microbatches)
    except ScheduleError as exc:  # interleaved needs M to be a multiple of its rounds
        assert name == "interleaved-1f1b" and "rounds" in str(exc)
        return
    rows = validate_schedule(s)
    split = s.split_backward()  # a W for each split B: every one (zero bubble) or some (dualpipev)
    assert schedule_kind(name).split_backward or not split
    assert sum(a is not None for row in rows for a in row) == 2 * s.num_stages * microbatches + len(
        split
    )
    assert s.stage_ranks == stage_ranks(ranks, s.virtual_stages, schedule_kind(name).placement)


def test_literal_lists() -> None:
    assert _lists(make_schedule("zb-h1", 3, 4)) == [
        "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ]
    assert _lists(make_schedule("interleaved-1f1b", 2, 2)) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
    ]
    assert _lists(make_schedule("zbv", 2, 2)) == [
        "0F0 0F1 3F0 3B0 3W0 3F1 3B1 3W1 0B0 0W0 0B1 0W1",
        "1F0 2F0 1F1 2F1 2B0 2W0 1B0 1W0 2B1 2W1 1B1 1W1",
    ]


def test_placement() -> None:
    assert stage_ranks(3, 2, "loop") == (0, 1, 2, 0, 1, 2)
    assert stage_ranks(3, 2, "v") == (0, 1, 2, 2, 1, 0)
    assert stage_ranks(2, 3, "v") == (0, 1, 1, 0, 0, 1)
    assert placement_of((0, 1, 1, 0)) == (2, 2, "v") and placement_of((0, 1)) == (2, 1, "loop")
    assert placements_of((0, 0)) == (1, 2, ("loop", "v"))  # one rank: both placements
    assert placements_of((0, 1, 0, 1)) == (2, 2, ("loop",))
    assert runnable_schedules(1, "loop") == ("gpipe", "1f1b", "zb-h1")
    assert runnable_schedules(2, "v") == ("zbv", "dualpipev") and runnable_schedules(3, "loop") == (
        "interleaved-1f1b",
    )
    with pytest.raises(ScheduleError, match="runs 2 stages per rank, not --virtual-stages 3"):
        make_schedule("zbv", 2, 4, 3)
    with pytest.raises(
        ScheduleError, match=r"3 rounds of 2, which needs a multiple of 3; use 6 or 9"
    ):
        make_schedule("interleaved-1f1b", 2, 7)


@pytest.mark.parametrize("S, M", [(2, 8), (4, 8), (4, 2), (6, 12)])
def test_activation_memory_in_microbatches(S: int, M: int) -> None:
    assert in_flight_per_stage(make_schedule("gpipe", S, M)) == (M,) * S
    assert in_flight_per_stage(make_schedule("1f1b", S, M)) == tuple(
        min(S - i, M) for i in range(S)
    )
    assert (
        in_flight_per_stage(make_schedule("zb-h1", S, M)) == (min(S, M),) * S
    )  # 1F1B's peak, on every stage


def test_bubbles_with_equal_f_b_w() -> None:
    """1F1B idles (S-1)(F+B); ZB-H1 a third of it; ZBV and interleaved less (Qi et al. 2023)."""
    S, M = 4, 8
    ideal = 3.0 * M
    steps = {name: _unit_times(make_schedule(name, S, M)) for name in SCHEDULE_NAMES}
    assert steps["1f1b"] == steps["gpipe"] == ideal + 3 * (S - 1)
    assert steps["zb-h1"] == ideal + (S - 1)
    assert steps["interleaved-1f1b"] == ideal + 3 * (S - 1) / 2
    assert steps["zbv"] == ideal + 1.5 < steps["zb-h1"]


def _edit(schedule: Schedule, rank: int, acts: str) -> Schedule:
    actions = list(schedule.actions)
    actions[rank] = tuple(Action.parse(a) for a in acts.split())
    return dataclasses.replace(schedule, actions=tuple(actions))


def test_validator_on_weight_actions() -> None:
    zb = make_schedule("zb-h1", 2, 2)  # rank 1: 1F0 1B0 1F1 1B1 1W0 1W1
    with pytest.raises(ScheduleError, match="1W0 runs before its backward 1B0"):
        validate_schedule(_edit(zb, 1, "1F0 1W0 1B0 1F1 1B1 1W1"))
    with pytest.raises(
        ScheduleError, match="1W0 comes after microbatch 1: microbatches must run in ascending"
    ):
        validate_schedule(_edit(zb, 1, "1F0 1B0 1F1 1B1 1W1 1W0"))
    with pytest.raises(ScheduleError, match="0W0 runs on rank 1 but stage 0 lives on rank 0"):
        validate_schedule(_edit(zb, 1, "1F0 1B0 1F1 1B1 1W0 1W1 0W0"))
    # W is optional per microbatch: a backward without W is the fused one
    fused_one = _edit(zb, 1, "1F0 1B0 1F1 1B1 1W1")
    validate_schedule(fused_one)
    assert (1, 0) not in fused_one.split_backward() and (1, 1) in fused_one.split_backward()


def test_schedule_json_round_trip_and_errors() -> None:
    s = make_schedule("zbv", 2, 4)
    assert Schedule.from_dict(s.to_dict()) == s
    with pytest.raises(ScheduleError, match="malformed schedule data"):
        Schedule.from_dict({"name": "x", "actions": ["0Q0"]})
    with pytest.raises(ScheduleError, match="stage_ranks has 3 entries for 2 stages"):
        Schedule("x", 2, 1, ((), ()), (0, 1, 0))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_the_runtime_runs_the_lists_the_planner_simulates(name: str) -> None:
    from fxpipe.runtime.pipeline.schedule import make_schedule as runtime_schedule

    assert runtime_schedule(name, 2, 4) == make_schedule(name, 2, 4)


def _peer_order(peer_class: str, ranks: int, microbatches: int) -> list[str]:
    """A torch.distributed.pipelining V schedule's order per rank, in fxpipe's notation (a paired
    forward and backward as its two actions; full and input-only backward both ``B``)."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    peer, kinds = getattr(schedules, peer_class), schedules._ComputationType
    letter = {
        kinds.FORWARD: "F",
        kinds.FULL_BACKWARD: "B",
        kinds.BACKWARD_INPUT: "B",
        kinds.BACKWARD_WEIGHT: "W",
    }
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches, num_stages=2 * ranks)
    rows = []
    for r in range(ranks):
        acts = []
        for a in peer._calculate_single_rank_operations(fake, r):
            for x in (
                ()
                if a is None
                else a.sub_actions
                if a.computation_type == kinds.OVERLAP_F_B
                else (a,)
            ):
                acts.append(f"{x.stage_index}{letter[x.computation_type]}{x.microbatch_index}")
        rows.append(" ".join(acts))
    return rows


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_zbv_runs_the_peers_order(ranks: int) -> None:
    for microbatches in range(1, 10):
        assert _lists(make_schedule("zbv", ranks, microbatches)) == _peer_order(
            "ScheduleZBVZeroBubble", ranks, microbatches
        )


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_dualpipev_runs_the_peers_order(ranks: int) -> None:
    for microbatches in range(2 * ranks, 2 * ranks + 4):  # the peer needs M >= 2S
        assert _lists(make_schedule("dualpipev", ranks, microbatches)) == _peer_order(
            "ScheduleDualPipeV", ranks, microbatches
        )
    s = make_schedule("dualpipev", 2, 4)
    assert (
        len(s.split_backward()) == 5
    )  # only the warm-up's last chunk and the cool-down split theirs
    assert _lists(s)[1] == "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 1W3"
