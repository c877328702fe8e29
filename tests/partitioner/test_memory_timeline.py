"""Memory over time (Note [memory over time]): the schedule walk's counts and the predicted rank peak."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from partition_fixtures import chain_profile

from fxpipe.errors import FxpipeError
from fxpipe.partitioner import CostModel, build_problem
from fxpipe.partitioner.prediction import (
    RUNTIME_COSTS,
    rank_memory_floor,
    rank_peak_memory,
    stage_bytes,
)
from fxpipe.partitioner.problem import PartitionProblem, Tensor
from fxpipe.partitioner.schedule import make_schedule
from fxpipe.partitioner.schedule.memory_walk import Holding, memory_moments, schedule_memory_moments


def _peak(schedule: str, rank: int, what: str) -> int:
    return max(
        getattr(m[0], what) for m in schedule_memory_moments(schedule, 2, 1, 4)[rank].moments
    )


def test_gpipe_peaks_in_its_first_backward_before_any_gradient_exists() -> None:
    first = schedule_memory_moments("gpipe", 2, 1, 4)[0]
    assert Holding(activations=4, outputs_sent=4, in_backward=1, grads=0) in {
        m[0] for m in first.moments
    }
    assert _peak("gpipe", 0, "activations") == 4 and _peak("1f1b", 0, "activations") == 2
    assert _peak("1f1b", 1, "activations") == 1


def test_receive_pools_hold_a_buffer_per_message_on_gloo_and_per_action_otherwise() -> None:
    # rank 0 receives gradients, rank 1 activations; posted at the step's start (gloo), a buffer per microbatch
    gloo = schedule_memory_moments("1f1b", 2, 1, 4)
    paired = memory_moments(make_schedule("1f1b", 2, 4), step_receives=False)
    assert (gloo[0].gradient_buffers, gloo[1].activation_buffers) == ((4,), (4,))
    assert (paired[0].gradient_buffers, paired[1].activation_buffers) == ((1,), (1,))
    assert gloo[0].activation_buffers == (0,) and gloo[1].gradient_buffers == (0,)
    # GPipe keeps every microbatch's input buffer until its backward, however they are posted
    assert memory_moments(make_schedule("gpipe", 2, 4), step_receives=False)[
        1
    ].activation_buffers == (4,)


def test_rank_peak_memory_counts_receive_buffers_as_the_runtime_posts_them() -> None:
    problem = _chain(
        (100, 100, 100, 100), (1000, 1000, 1000, 1000), (10, 10, 10, 10), schedule="1f1b"
    )
    a = (0, 0, 1, 1)
    gloo = rank_peak_memory(problem, a, runtime=RUNTIME_COSTS["cpu"])
    nccl = rank_peak_memory(problem, a, runtime=RUNTIME_COSTS["cuda"])
    workspace = RUNTIME_COSTS["cuda"].workspace_bytes  # cuBLAS's, beside the tensors
    # 1F1B on 2 ranks, 4 microbatches: gloo posts 4 receives of 1000 bytes per rank, NCCL one at a time
    assert [g - (n - workspace) for g, n in zip(gloo, nccl)] == [3 * 1000, 3 * 1000]


def test_split_backward_keeps_gradients_until_w_and_holds_buffers_longer() -> None:
    zb = schedule_memory_moments("zb-h1", 2, 1, 4)
    assert _peak("zb-h1", 1, "weight_pending") == 2 and _peak("1f1b", 1, "weight_pending") == 0
    assert zb[1].activation_buffers == (4,)  # gloo: every receive posted at the step's start
    paired = memory_moments(make_schedule("zb-h1", 2, 4), step_receives=False)
    # released at W, not at B: two held at once where 1F1B holds one
    assert paired[1].activation_buffers == (2,)
    assert memory_moments(make_schedule("1f1b", 2, 4), step_receives=False)[
        1
    ].activation_buffers == (1,)
    assert all(
        m[0].weight_pending == 0 or m[0].activations >= m[0].weight_pending for m in zb[1].moments
    )


def test_moments_are_not_dominated_and_cover_every_stage_of_a_rank() -> None:
    for rank in schedule_memory_moments("interleaved-1f1b", 2, 2, 4):
        assert rank.stages in ((0, 2), (1, 3)) and all(len(m) == 2 for m in rank.moments)
        tuples = [sum((tuple(h.__dict__.values()) for h in m), ()) for m in rank.moments]
        for a in tuples:
            assert not any(b != a and all(x >= y for x, y in zip(b, a)) for b in tuples)


def _chain(
    acts: tuple[int, ...], outs: tuple[int, ...], params: tuple[int, ...], **kw: object
) -> PartitionProblem:
    n = len(acts)
    return PartitionProblem(
        names=tuple(f"u{i}" for i in range(n)),
        module_paths=tuple(f"u{i}" for i in range(n)),
        fwd_ms=(1.0,) * n,
        bwd_ms=(2.0,) * n,
        activation_bytes=acts,
        buffer_bytes=(0,) * n,
        unit_params=tuple((i,) for i in range(n)),
        param_bytes=params,
        param_names=tuple(f"p{i}" for i in range(n)),
        tensors=tuple(Tensor(i, (i + 1,), outs[i]) for i in range(n - 1)),
        pins=(None,) * n,
        num_stages=2,
        microbatches=4,
        output_bytes=outs,
        **kw,
    )  # type: ignore[arg-type]


def test_rank_peak_in_bytes_under_1f1b_and_gpipe() -> None:
    # two units, one per stage; activations 1000 / 2000, outputs 100 / 10, parameters 40 / 60 bytes,
    # SGD (no optimizer state), inputs 7 bytes per microbatch
    problem = _chain(
        (1000, 2000), (100, 10), (40, 60), input_bytes=7, cost=CostModel(optimizer="sgd")
    )
    sizes = stage_bytes(problem, (0, 1))
    assert (
        sizes[0].backward_temporary == 2 * 100 + 40 and sizes[1].backward_temporary == 2 * 10 + 60
    )
    assert (
        sizes[0].outputs_sent,
        sizes[0].gradient_buffer,
        sizes[1].grads_sent,
        sizes[1].activation_buffer,
    ) == (100, 100, 100, 100)
    data = 4 * 7
    # gloo posts the step's 4 receives at its start: 4 receive buffers of 100 bytes on each rank
    # 1F1B rank 0 peaks in B with 2 microbatches held, 4 outputs sent, gradients made
    assert (
        rank_peak_memory(problem, (0, 1), "1f1b")[0]
        == data + 40 + 4 * 100 + 2 * 1000 + 4 * 100 + 240 + 40
    )
    # GPipe rank 0: its first B, all 4 held, no gradient yet
    assert (
        rank_peak_memory(problem, (0, 1), "gpipe")[0]
        == data + 40 + 4 * 100 + 4 * 1000 + 4 * 100 + 240
    )
    # rank 1, 1F1B: its last B (1 held, 3 gradients sent) against after it (4 sent): the B with its temporaries
    assert (
        rank_peak_memory(problem, (0, 1), "1f1b")[1]
        == data + 60 + 4 * 100 + 2000 + 3 * 100 + 80 + 60
    )


def test_recomputation_holds_no_activations_and_rebuilds_one_microbatch_in_backward() -> None:
    problem = _chain(
        (1000, 2000), (100, 10), (40, 60), input_bytes=7, cost=CostModel(optimizer="sgd")
    )
    plain = rank_peak_memory(problem, (0, 1), "gpipe")[0]
    recomputing = replace(problem, cost=CostModel(optimizer="sgd", recompute=(True, False)))
    assert stage_bytes(recomputing, (0, 1))[0].activations == 0
    # 4 held -> 1 rebuilt in B; the peak moves to a later B, once the gradients (40 bytes) exist
    assert plain - rank_peak_memory(recomputing, (0, 1), "gpipe")[0] == 3 * 1000 - 40


@pytest.mark.parametrize(
    "name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)]
)
def test_peak_over_all_moments_equals_the_peak_over_the_undominated_ones(name: str, v: int) -> None:
    import random

    rnd = random.Random(7)
    for rank in schedule_memory_moments(name, 3, v, 6):
        sizes = [[rnd.randrange(0, 1000) for _ in range(7)] for _ in rank.stages]
        by_hand = max(
            sum(c * b for h, row in zip(m, sizes) for c, b in zip(h.__dict__.values(), row))
            for m in rank.moments
        )
        assert rank.peak(sizes) == by_hand


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, 10**6),
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv", "dualpipev"]),
    st.sampled_from(["cpu", "cuda"]),
    st.booleans(),
    st.integers(2, 4),
    st.sampled_from([1, 2, 4, 8]),
)
def test_the_memory_floor_never_exceeds_the_walk(
    seed: int, schedule: str, device: str, recompute: bool, ranks: int, microbatches: int
) -> None:
    # the cluster search rejects and recomputes on these floors before walking: they must bound every walk
    rng = random.Random(seed)
    V = 2 if schedule in ("interleaved-1f1b", "zbv", "dualpipev") else 1
    S = ranks * V
    n = rng.randint(S, S + 6)
    profile = chain_profile(
        [rng.uniform(0.5, 3) for _ in range(n)],
        [rng.choice([0, 400, 4000]) for _ in range(n - 1)],
        params=[1000 * rng.randint(0, 20) for _ in range(n)],
        activations=[500 * rng.randint(0, 8) for _ in range(n)],
    )
    cost = CostModel(optimizer=rng.choice(["sgd", "adam"]), dp_replicas=rng.choice([1, 2]))
    cost = replace(
        cost, shard=rng.choice(["none", "optimizer", "grad-op"]) if cost.dp_replicas > 1 else "none"
    )
    try:
        problem = build_problem(
            profile,
            ranks,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=V,
            cost=cost,
        )
    except FxpipeError:  # a count the schedule refuses
        return
    cuts = sorted(rng.sample(range(1, n), S - 1))
    assignment = tuple(sum(u >= c for c in cuts) for u in range(n))
    floor = rank_memory_floor(problem, assignment, RUNTIME_COSTS[device])
    activations = floor.activations
    if recompute and not make_schedule(schedule, ranks, microbatches, V).split_backward():
        problem = replace(problem, cost=replace(problem.cost, recompute=(True,) * S))
        activations = floor.recomputed
    walked = rank_peak_memory(problem, assignment, runtime=RUNTIME_COSTS[device])
    for r in range(ranks):
        assert floor.at_end[r] <= walked[r] and floor.always[r] + activations[r] <= walked[r]
