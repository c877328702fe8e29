"""The step prediction: runtime costs per action, per message and per step (literal values)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from partition_fixtures import chain_profile

from fxpipe.errors import PartitionError
from fxpipe.partitioner import CostModel, build_problem, plan_partition, predict
from fxpipe.partitioner.schedule import ActionKind, make_schedule, simulate_step
from fxpipe.partitioner.prediction import RUNTIME_COSTS, RuntimeCosts, simulate_plan, step_overheads
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge

FREE = RuntimeCosts()  # every runtime cost zero: the bare simulation
LINK = CostModel(link_bandwidth=1e6, link_latency=0.0)  # 1000 bytes take 1 ms


def _two_units(edge_bytes: int = 1000, tied: bool = False) -> ModelProfile:
    """u0 (fwd 1, bwd 2 ms) -> u1 (fwd 1, bwd 2 ms); params a (1000 B) and b (500 B), or a tied to b."""
    units = (
        Unit(
            name="u0",
            module_path="a",
            fwd_ms=1.0,
            bwd_ms=2.0,
            params=("a.weight",),
            outputs=(TensorSpec((1, edge_bytes // 4)),),
        ),
        Unit(name="u1", module_path="b", fwd_ms=1.0, bwd_ms=2.0, params=("b.weight",)),
    )
    sizes = {"a.weight": 1000} if tied else {"a.weight": 1000, "b.weight": 500}
    ties = (("a.weight", "b.weight"),) if tied else ()
    return ModelProfile(
        units=units,
        edges=(UnitEdge("u0", "u1", edge_bytes),),
        batch_size=2,
        param_sizes=sizes,
        ties=ties,
    )


def test_free_runtime_matches_the_bare_simulation() -> None:
    problem = build_problem(
        chain_profile([3.0] * 4), 4, microbatches=8, schedule="gpipe", cost=LINK
    )
    pred = predict(problem, (0, 1, 2, 3), 1, runtime=FREE)
    assert pred.pipeline_ms["gpipe"] == pytest.approx((8 + 4 - 1) * 3.0)
    assert pred.step_overhead_ms.total_ms == pytest.approx(
        0.004
    )  # only the loss broadcast: 4 B at 1 MB/s
    assert pred.step_ms["gpipe"] == pytest.approx(33.004)


def test_action_cost_is_paid_by_every_forward_and_backward() -> None:
    problem = build_problem(chain_profile([3.0, 3.0]), 2, microbatches=2, schedule="gpipe")
    pred = predict(problem, (0, 1), 1, runtime=RuntimeCosts(action_ms=0.5))
    assert pred.pipeline_ms["gpipe"] == pytest.approx((2 + 2 - 1) * (1.5 + 2.5))


def test_messages_cost_cpu_on_both_ends_and_delay_the_consumer() -> None:
    problem = build_problem(_two_units(), 2, microbatches=1, schedule="gpipe", cost=LINK)
    pred = predict(problem, (0, 1), 2, runtime=RuntimeCosts(message_ms=0.25))
    # F0 1.25 | link 1 | F1 1.25, B1 2.25 | link 1 | B0 2.25  -> 9.0
    assert pred.pipeline_ms["gpipe"] == pytest.approx(9.0)
    assert pred.step_overhead_ms.loss_broadcast_ms == pytest.approx(0.004)  # 4 bytes over 1 MB/s
    assert pred.step_ms["gpipe"] == pytest.approx(9.004)


def test_receives_posted_at_the_step_start_are_paid_before_the_first_action() -> None:
    problem = build_problem(_two_units(), 2, microbatches=1, schedule="gpipe", cost=LINK)
    runtime = RuntimeCosts(message_ms=0.25, step_receives=True)
    # rank 0 posts B0's receive [0, 0.25], F0 + its send [0.25, 1.5] | link 1 | rank 1 posted F1's receive
    # while it waited: F1 [2.5, 3.5], B1 + its send [3.5, 5.75] | link 1 | B0, its receive already posted, 2.0
    assert predict(problem, (0, 1), 2, runtime=runtime).pipeline_ms["gpipe"] == pytest.approx(8.75)
    line = simulate_plan(problem, (0, 1), runtime)
    assert [(str(op), round(op.start_ms, 9), round(op.end_ms, 9)) for op in line.ops] == [
        ("0F0", 0.25, 1.5),
        ("1F0", 2.5, 3.5),
        ("1B0", 3.5, 5.75),
        ("0B0", 6.75, 8.75),
    ]


def test_messages_stall_only_where_an_action_starts_on_busy_cores() -> None:
    # Note [message stalls]: one microbatch never runs two actions at once, so its messages never stall
    # (the literal 9.0 above); two microbatches run F1 of stage 0 beside F0 of stage 1, and a stall costs time
    stalling = RuntimeCosts(message_ms=0.25, message_stall_ms=0.5)
    one = build_problem(_two_units(), 2, microbatches=1, schedule="gpipe", cost=LINK)
    assert predict(one, (0, 1), 2, runtime=stalling).pipeline_ms["gpipe"] == pytest.approx(9.0)
    two = build_problem(_two_units(), 2, microbatches=2, schedule="gpipe", cost=LINK)
    plain = predict(two, (0, 1), 2, runtime=replace(stalling, message_stall_ms=0.0)).pipeline_ms[
        "gpipe"
    ]
    assert plain < predict(two, (0, 1), 2, runtime=stalling).pipeline_ms["gpipe"] <= plain + 8 * 0.5
    cpu = RUNTIME_COSTS[
        "cpu"
    ]  # gloo's median call, and the mean's rest when both ranks compute (0.28-0.42)
    assert (cpu.message_ms, cpu.message_ms + cpu.message_stall_ms) == pytest.approx((0.06, 0.42))


def test_step_overheads_literal() -> None:
    runtime = RuntimeCosts(
        step_ms=0.5, optimizer_step_ms=0.1, optimizer_tensor_ms=0.01, optimizer_bytes_per_s=1e6
    )
    cost = CostModel(link_bandwidth=1e6, link_latency=1e-3, optimizer="momentum")
    problem = build_problem(_two_units(tied=True), 2, cost=cost)
    got = step_overheads(problem, (0, 1), runtime)
    assert got.tied_all_reduce_ms == pytest.approx(2 * (1.0 + 1.0))  # two link messages of 1000 B
    assert got.loss_broadcast_ms == pytest.approx(1.004)
    assert got.optimizer_ms == pytest.approx(
        0.1 + 0.01 + 5 * 1000 / 1e6 * 1e3
    )  # momentum: 5 passes
    assert got.total_ms == pytest.approx(4.0 + 1.004 + 5.11 + 0.5)
    alone = step_overheads(build_problem(_two_units(tied=True), 1, cost=cost), (0, 0), runtime)
    assert alone.tied_all_reduce_ms == 0.0 and alone.loss_broadcast_ms == 0.0
    # each hop of the step-end collectives also pays collective_ms: 2 hops of the all-reduce, 1 of the broadcast
    hops = step_overheads(problem, (0, 1), RuntimeCosts(collective_ms=0.25))
    assert hops.tied_all_reduce_ms == pytest.approx(
        2 * (2.0 + 0.25)
    ) and hops.loss_broadcast_ms == pytest.approx(1.004 + 0.25)


def test_slowest_optimizer_counts() -> None:
    runtime = RuntimeCosts(optimizer_tensor_ms=1.0, optimizer_bytes_per_s=1e6)
    problem = build_problem(_two_units(), 2, cost=LINK)  # stage 0 holds 1000 B, stage 1 500 B
    assert step_overheads(problem, (0, 1), runtime).optimizer_ms == pytest.approx(
        1.0 + 3 * 1000 / 1e3
    )


def test_plan_carries_the_cpu_runtime_costs_and_more_fields() -> None:
    plan = plan_partition(_two_units(), 2, microbatches=2)
    pred = plan.prediction
    assert pred.runtime_costs == RUNTIME_COSTS["cpu"]
    for schedule in ("gpipe", "1f1b"):
        assert pred.step_ms[schedule] == pytest.approx(
            pred.pipeline_ms[schedule] + pred.step_overhead_ms.total_ms
        )
    assert pred.step_overhead_ms.optimizer_ms > 0 and pred.step_overhead_ms.loss_broadcast_ms > 0


def test_simulator_gradient_link_delay_literal() -> None:
    times = {ActionKind.FORWARD: 1.0, ActionKind.BACKWARD: 2.0}
    gpipe = make_schedule("gpipe", 2, 2)

    def step(activation_ms: float, gradient_ms: float) -> float:
        return simulate_step(
            gpipe,
            lambda a: times[a.kind],
            delay=lambda ln, kind: activation_ms if kind is ActionKind.FORWARD else gradient_ms,
        ).step_ms

    assert step(0.5, 0.25) == pytest.approx(9.75)
    assert step(0.5, 0.5) == pytest.approx(10.0)


def test_shared_cores_share_compute_between_running_ranks_not_links() -> None:
    from fxpipe.partitioner.prediction import shared_cores

    base = RuntimeCosts(message_ms=0.25, step_ms=1.0)
    shared = shared_cores(base, processes=4, cores=2)
    assert shared.rank_speed == 0.5 and shared_cores(base, processes=2, cores=4).rank_speed == 1.0
    problem = build_problem(_two_units(), 2, microbatches=1, schedule="gpipe", cost=LINK)
    pred = predict(problem, (0, 1), 2, runtime=shared)
    # 2 ranks of 4 processes on 2 cores: this pipeline shares one core. With one microbatch no two actions
    # run at once, so each runs at full speed, as in the messages test: F0 1.25 | 1 | F1 1.25, B1 2.25 | 1 | B0 2.25
    assert pred.pipeline_ms["gpipe"] == pytest.approx(9.0)
    assert pred.step_overhead_ms.fixed_ms == pytest.approx(2.0)  # every rank at once: half speed
    two = build_problem(_two_units(), 2, microbatches=2, schedule="gpipe", cost=LINK)
    alone, shared_two = (
        predict(two, (0, 1), 2, runtime=base),
        predict(two, (0, 1), 2, runtime=shared),
    )
    # F1 of stage 0 and F0 of stage 1 overlap on one core: slower than one core each, never over twice
    assert (
        alone.pipeline_ms["gpipe"]
        < shared_two.pipeline_ms["gpipe"]
        < 2 * alone.pipeline_ms["gpipe"]
    )
    assert pred.runtime_costs.to_dict()["rank_speed"] == 0.5  # recorded with the prediction
    with pytest.raises(PartitionError):
        shared_cores(base, processes=0, cores=2)
    with pytest.raises(PartitionError):
        RuntimeCosts(rank_speed=0.0)
    # ranks that outnumber the cores also pay the switching: the per-step Python at 0.5 x 0.8 of a core
    slower = replace(shared, oversubscribed_rate=0.8)
    assert (
        slower.busy_speed == pytest.approx(0.4)
        and replace(base, oversubscribed_rate=0.8).busy_speed == 1.0
    )
    assert predict(problem, (0, 1), 2, runtime=slower).step_overhead_ms.fixed_ms == pytest.approx(
        2.5
    )
    assert (
        predict(two, (0, 1), 2, runtime=slower).pipeline_ms["gpipe"]
        > shared_two.pipeline_ms["gpipe"]
    )
    with pytest.raises(PartitionError, match="oversubscribed_rate"):
        RuntimeCosts(oversubscribed_rate=1.5)


def test_split_backward_costs_split_factor_and_a_stage_without_input_grads_runs_all_in_w() -> None:
    # Note [split backward cost]. u0 and u1: fwd 1, bwd 2 of which W 0.8 (weight_grad_fraction 0.4);
    # the 1000-byte edge takes 1 ms on LINK. ZB-H1, one microbatch, split_factor 1.5:
    # F(s0) [0, 1] | link | F(s1) [2, 3]; B(s1) (2 - 0.8) x 1.5 = 1.8 [3, 4.8]; W(s1) 0.8 x 1.5 [4.8, 6.0];
    # stage 0's inputs need no gradient: its B is empty [5.8, 5.8] and its W the whole fused 2 ms [5.8, 7.8]
    base = _two_units()
    units = tuple(u.__class__(**{**u.__dict__, "weight_grad_fraction": 0.4}) for u in base.units)
    profile = ModelProfile(
        units=units, edges=base.edges, batch_size=2, param_sizes=base.param_sizes
    )
    problem = build_problem(profile, 2, microbatches=1, schedule="zb-h1", cost=LINK)
    pred = predict(problem, (0, 1), 2, runtime=RuntimeCosts(split_factor=1.5))
    assert pred.pipeline_ms["zb-h1"] == pytest.approx(7.8)
    # factor 1: B(s1) 1.2 [3, 4.2], W(s1) [4.2, 5.0]; stage 0 from 5.2, its W 2 ms
    assert predict(problem, (0, 1), 2, runtime=FREE).pipeline_ms["zb-h1"] == pytest.approx(7.2)
    # W calls the engine once per group of parameters where B left boundary gradients: stage 1's W (one
    # unit with parameters) + 0.5, [4.2, 5.5], off the critical path; stage 0's whole backward is one call
    # (split_backward.SplitBackward.inputs), the fused backward's own: no per-group cost, still 7.2
    calls = predict(problem, (0, 1), 2, runtime=RuntimeCosts(weight_call_ms=0.5)).pipeline_ms[
        "zb-h1"
    ]
    assert calls == pytest.approx(7.2)


def test_recomputing_stage_pays_its_checkpoint_region_per_call_and_per_saved_tensor() -> None:
    # Note [recompute cost]. u0 saves 3 tensors, u1 5; stage 1 recomputes. GPipe, one microbatch, FREE but
    # the region costs: F(s0) [0, 1] | link 1 | F(s1) 1 + 0.5 + 5 x 0.1 = 2 [2, 4]; B(s1) 2 + the repeated
    # forward 1 + 0.25 + 5 x 0.2 = 4.25 [4, 8.25] | link 1 | B(s0) 2 [9.25, 11.25]
    base = _two_units()
    units = tuple(
        u.__class__(**{**u.__dict__, "saved_tensors": n}) for u, n in zip(base.units, (3, 5))
    )
    profile = ModelProfile(
        units=units, edges=base.edges, batch_size=2, param_sizes=base.param_sizes
    )
    region = RuntimeCosts(
        recompute_fwd_ms=0.5,
        recompute_bwd_ms=0.25,
        recompute_fwd_saved_ms=0.1,
        recompute_bwd_saved_ms=0.2,
    )
    cost = CostModel(link_bandwidth=1e6, link_latency=0.0, recompute=(False, True))
    problem = build_problem(profile, 2, microbatches=1, schedule="gpipe", cost=cost)
    assert predict(problem, (0, 1), 2, runtime=region).pipeline_ms["gpipe"] == pytest.approx(11.25)
    assert predict(problem, (0, 1), 2, runtime=FREE).pipeline_ms["gpipe"] == pytest.approx(
        9.0
    )  # forward only
    plain = build_problem(profile, 2, microbatches=1, schedule="gpipe", cost=LINK)
    assert predict(plain, (0, 1), 2, runtime=region).pipeline_ms["gpipe"] == pytest.approx(
        8.0
    )  # no region
    old = build_problem(
        base, 2, microbatches=1, schedule="gpipe", cost=cost
    )  # a profile without the counts
    assert predict(old, (0, 1), 2, runtime=region).pipeline_ms["gpipe"] == pytest.approx(9.75)


def test_data_parallel_collectives_pay_collective_ms_per_ring_hop() -> None:
    cost = CostModel(link_bandwidth=1e6, link_latency=0.0, dp_replicas=3)
    problem = build_problem(_two_units(), 2, cost=cost)
    bare = step_overheads(problem, (0, 1), RuntimeCosts()).dp_all_reduce_ms
    hops = problem.dp_hops(
        [0]
    )  # stage 0's one bucket: a ring all-reduce over 3 replicas, 2(R-1) hops
    assert hops == 4
    paid = step_overheads(problem, (0, 1), RuntimeCosts(collective_ms=0.5)).dp_all_reduce_ms
    assert paid == pytest.approx(bare + 4 * 0.5)
    shared = step_overheads(
        problem, (0, 1), RuntimeCosts(collective_ms=0.5, rank_speed=0.5)
    ).dp_all_reduce_ms
    assert shared == pytest.approx(bare + 4 * 1.0)  # CPU on shared cores


def test_ddp_sync_pass_costs_per_step_and_per_parameter_tensor_on_ddp_levels_only() -> None:
    # Note [data-parallel sync cost]: stage 0 holds one parameter tensor, stage 1 another (the slowest
    # counts); the pass is CPU work, shared like the optimizer step on shared cores
    runtime = RuntimeCosts(dp_sync_ms=1.0, dp_sync_tensor_ms=0.25)
    replicated = build_problem(
        _two_units(), 2, cost=CostModel(link_bandwidth=1e6, link_latency=0.0, dp_replicas=2)
    )
    bare = step_overheads(replicated, (0, 1), RuntimeCosts()).dp_all_reduce_ms
    assert step_overheads(replicated, (0, 1), runtime).dp_all_reduce_ms == pytest.approx(
        bare + 1.25
    )
    both = step_overheads(
        replicated, (0, 0), runtime
    ).dp_all_reduce_ms  # one rank holds both tensors
    assert both == pytest.approx(
        step_overheads(replicated, (0, 0), RuntimeCosts()).dp_all_reduce_ms + 1.5
    )
    shared = replace(runtime, rank_speed=0.5)
    assert step_overheads(replicated, (0, 1), shared).dp_all_reduce_ms == pytest.approx(bare + 2.5)
    alone = build_problem(_two_units(), 2, cost=LINK)  # no replicas: no pass
    assert step_overheads(alone, (0, 1), runtime).dp_all_reduce_ms == 0.0
    for level, paid in (
        ("optimizer", True),
        ("full", False),
    ):  # ZeRO-1 runs DDP's hook; FSDP has no such pass
        cost = CostModel(link_bandwidth=1e6, link_latency=0.0, dp_replicas=2, shard=level)
        problem = build_problem(_two_units(), 2, cost=cost)
        extra = (
            step_overheads(problem, (0, 1), runtime).dp_all_reduce_ms
            - step_overheads(problem, (0, 1), RuntimeCosts()).dp_all_reduce_ms
        )
        assert extra == pytest.approx(1.25 if paid else 0.0)


def test_host_slowdown_scales_the_runtimes_cpu_work_only() -> None:
    from fxpipe.partitioner.prediction import at_host_speed, runtime_costs_for

    cpu = RUNTIME_COSTS["cpu"]
    slow = at_host_speed(cpu, 2.0)
    assert slow.host_slowdown == 2.0
    for name in (
        "action_ms",
        "message_ms",
        "dp_sync_ms",
        "collective_ms",
        "step_ms",
        "optimizer_step_ms",
        "recompute_bwd_saved_ms",
        "split_unit_ms",
    ):
        assert getattr(slow, name) == pytest.approx(2 * getattr(cpu, name)), name
    assert slow.optimizer_bytes_per_s == pytest.approx(cpu.optimizer_bytes_per_s / 2)
    for name in (
        "message_stall_ms",
        "split_factor",
        "oversubscribed_rate",
        "rank_speed",
        "workspace_bytes",
        "step_receives",
    ):  # OS time slices, ratios and sizes do not follow the CPU's speed
        assert getattr(slow, name) == getattr(cpu, name), name
    thrice = at_host_speed(cpu, 3.0)  # from the calibration's speed, not compounded
    again = at_host_speed(slow, 3.0).to_dict()
    assert again.keys() == thrice.to_dict().keys()
    for name, value in thrice.to_dict().items():
        assert again[name] == (pytest.approx(value) if isinstance(value, float) else value), name
    assert at_host_speed(slow, 1.0) == cpu
    assert runtime_costs_for("cpu", 2.0) == slow and runtime_costs_for("cpu") is cpu
    with pytest.raises(PartitionError, match="slowdown"):
        at_host_speed(cpu, 0.0)


def test_plan_prices_the_fixed_costs_at_the_traced_hosts_speed() -> None:
    from fxpipe.tracer.measure.calibration import DEVICE_PRESETS

    quiet = DEVICE_PRESETS["cpu"].call_ms
    assert quiet is not None
    calibrated = plan_partition(
        replace(_two_units(), host_call_ms=quiet), 2, microbatches=2
    ).prediction
    slow = plan_partition(
        replace(_two_units(), host_call_ms=2 * quiet), 2, microbatches=2
    ).prediction
    assert calibrated is not None and slow is not None
    assert calibrated.runtime_costs == RUNTIME_COSTS["cpu"]
    assert slow.runtime_costs.host_slowdown == pytest.approx(2.0)
    # the unit times are the same: only the runtime's own work grows, and the optimizer's the most
    assert slow.step_overhead_ms.optimizer_ms > 1.9 * calibrated.step_overhead_ms.optimizer_ms
    for schedule in ("gpipe", "1f1b"):
        assert (
            calibrated.step_ms[schedule] < slow.step_ms[schedule] < 2 * calibrated.step_ms[schedule]
        )
