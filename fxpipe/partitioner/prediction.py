"""Step prediction: a split's step time under each schedule it can run, its bubble and per-rank memory.

Note [step prediction]: ``predict`` runs the step simulator (``simulate_step``, Note [step
simulation]) on the schedule's own action lists, with what the runtime really does per
action and per step, which on small models is most of a step. The fixed costs are
``RuntimeCosts``, one preset per trace device built from ``fxpipe/calibration.json`` (Note
[calibration data] in :mod:`fxpipe.calibration_data`):

* every F, B or W action pays the executor's bookkeeping (``RuntimeCosts.action_ms``);
  each message costs CPU to post and complete (``message_ms``), which its action pays,
  except that on gloo, where every receive of the step is posted when the step starts
  (``step_receives``), each rank pays for all its receives first, before its first
  action can start (the simulator's ``prologue``), and each action then pays only for
  its sends; an action that starts while every core is busy also waits the scheduler
  time slices its calls wait for gloo's transport thread (``message_stall_ms`` per
  message it sends or receives, since completing a receive needs that thread too; off
  the cores: Note [message stalls]); the message itself delays the consumer by the link
  time ``CostModel.message_ms(bytes)`` (simulated as a link delay, not as stage time);
  stages on one rank exchange no message;
* a split backward (zero-bubble schedules) runs the input-gradient part of the stage's
  backward in ``B`` (``bwd_ms - bwd_weight_ms``, from the profile's per-unit FLOP split)
  plus the walk of the saved graph (``split_ms`` + ``split_unit_ms`` per unit of the
  stage), and the weight-gradient part in ``W`` plus one engine call per group of
  parameters (``weight_call_ms`` per unit with parameters); both parts cost
  ``split_factor`` times their share of the fused backward (Note [split backward cost]);
  a stage none of whose inputs needs a gradient (the first stage, fed token ids) runs
  its whole backward in ``W`` as one engine call at the fused cost, and its ``B`` is
  bookkeeping only;
* a recomputing stage's ``B`` runs its forward again (in the stage costs) and both its
  actions pay ``torch.utils.checkpoint``'s own costs (Note [recompute cost]);
* once per step, after the pipeline drains: one all-reduce per tied parameter shared by
  several ranks (a ring: 2(k-1) link messages of its bytes over k ranks), the loss
  broadcast (one small message), each hop of these collectives also paying
  ``collective_ms`` (as does every hop of the data-parallel collectives: inside a running
  step a collective costs several times its standalone link time), and the slowest
  stage's ``zero_grad`` + optimizer step (a fixed cost per parameter tensor plus
  streaming its bytes, weight + gradient + optimizer state), plus a fixed ``step_ms`` of
  Python around the step.

The solver's stage costs (``evaluate``) are unchanged; only the prediction adds these.

Note [data-parallel sync cost]: replicas of a stage average their gradients once per step
with DDP's synchronising pass (Note [one all-reduce per step] in
``fxpipe.runtime.dataparallel.replica``): a forward and a backward over every parameter
tensor, DDP's reducer copying the gradients into its bucket and back, around the
all-reduce itself. On CPU that pass costs far more than the all-reduce's link time, and
grows with the number of parameter tensors more than with their bytes. So a rank with
replicas also pays ``dp_sync_ms`` + ``dp_sync_tensor_ms`` per parameter tensor, as CPU
work shared like the optimizer step (``busy_speed``). DDP-based levels only (no sharding,
or optimizer-state sharding's DDP hook); FSDP's collectives pay their link time and
``collective_ms`` alone. A device whose calibration has no figure for it (0) pays nothing.

Note [split backward cost]: splitting one backward into ``B`` and ``W`` runs the same
kernels (a boundary node such as a Linear's runs twice, each time one branch), yet
costs more than the fused backward beyond its fixed Python costs: autograd's engine
runs once for ``B`` and once per parameter group for ``W``, and ``W``'s kernels read
activations and kept gradients that left the cache since ``B``. The model prices this
as one ratio, ``split_factor``, over the fused time of both parts, fitted on blocks of
a mid-sized GPT; small kernels pay the extra engine work more, so it under-prices the
split of a tiny model. 1.0 (no extra) where the device's calibration has no figure.

Note [recompute cost]: a stage that recomputes runs its forward under one non-reentrant
``torch.utils.checkpoint`` region, which costs more than the forward it repeats: a fixed
cost per region (entering it, stashing the RNG state; rebuilding the graph in backward)
and a Python hook call per tensor autograd saves, one at pack time in ``F`` and one each
when the recomputation stores it and the backward unpacks it in ``B``. The profile counts
the saved tensors per unit (``Unit.saved_tensors``); ``F`` pays ``recompute_fwd_ms`` +
``recompute_fwd_saved_ms`` per saved tensor, ``B`` ``recompute_bwd_ms`` +
``recompute_bwd_saved_ms`` per saved tensor beyond the repeated forward. On a small block
this makes the region cost a few times the forward it repeats. Where activations are large
the recomputing backward costs no more than the plain one plus a forward, and the fixed
and per-tensor terms overcharge it. 0 where the device's calibration has no figure.

Note [shared cores]: the prediction assumes one core per rank. A local run with more
processes than cores (4 or 2x2 ranks on 2 cores) is a different cluster:
``shared_cores`` makes it explicit as ``RuntimeCosts.rank_speed = cores / processes``:
the pipeline's ranks share ``rank_speed x ranks`` cores (the replicas run the same
pipeline at the same time), and the step simulation shares them among the actions
running at each moment (Note [processor sharing]): an action runs at full speed while
enough of the other ranks wait (a waiting rank's gloo receive sleeps and yields its
core), and ``rank_speed`` of it while every rank computes, less the switching cost of
more running ranks than cores (``oversubscribed_rate``). The per-step
optimizer and Python time, which every rank spends at once, are divided by that speed
(``RuntimeCosts.busy_speed``). Link
delays are not shared. Nothing applies it silently:
``predict`` uses it only when given such a ``RuntimeCosts``, and it is recorded in the
prediction's ``runtime_costs``.
Predicted: every schedule that runs on the split's placement (``runnable_schedules``):
with one stage per rank GPipe, 1F1B and ZB-H1; loop-placed chunks interleaved 1F1B;
V-placed chunks ZBV.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fxpipe.calibration_data import names, values
from fxpipe.errors import PartitionError
from fxpipe.partitioner.problem import Evaluation, PartitionProblem, evaluate
from fxpipe.partitioner.schedule import (
    Action,
    ActionKind,
    Link,
    Timeline,
    make_schedule,
    runnable_schedules,
    simulate_step,
)
from fxpipe.partitioner.schedule.memory_walk import schedule_memory_moments
from fxpipe.schema import NonNegFloat, NonNegInt

__all__ = [
    "RuntimeCosts",
    "RUNTIME_COSTS",
    "StepOverheads",
    "Prediction",
    "predict",
    "step_overheads",
    "simulate_plan",
    "predicted_schedules",
    "shared_cores",
    "StageBytes",
    "stage_bytes",
    "rank_peak_memory",
    "MemoryFloor",
    "rank_memory_floor",
    "runtime_costs_for",
    "at_host_speed",
]

_LOSS_BYTES = 4  # the step's loss, broadcast from the last stage as one float32


@dataclass(frozen=True)
class RuntimeCosts:
    """Fixed costs of fxpipe's runtime beyond unit compute and link time (Note [step prediction])."""

    action_ms: NonNegFloat = (
        0.0  # executor bookkeeping per F, B or W action (buffers, dicts, checks)
    )
    split_ms: NonNegFloat = 0.0  # a split B: finding the boundary nodes, keeping their gradients
    split_unit_ms: NonNegFloat = 0.0  # ... plus this per unit of the stage (the graph walk)
    weight_call_ms: NonNegFloat = 0.0  # W: one engine call per unit with parameters
    split_factor: NonNegFloat = (
        1.0  # a split B + W over the fused backward (Note [split backward cost])
    )
    message_ms: NonNegFloat = 0.0  # CPU time per message to post and complete it, on each end
    message_stall_ms: NonNegFloat = (
        0.0  # ... and the wait per message when every core is busy (Note [message stalls])
    )
    dp_sync_ms: NonNegFloat = (
        0.0  # DDP's synchronising pass per step, beyond its all-reduce's link time
    )
    dp_sync_tensor_ms: NonNegFloat = (
        0.0  # ... plus this per parameter tensor (Note [data-parallel sync cost])
    )
    collective_ms: NonNegFloat = 0.0  # per ring hop of a step-end collective, beyond its link time
    loss_ms: NonNegFloat = 0.0  # loss forward + backward per microbatch, on the last stage
    step_ms: NonNegFloat = 0.0  # Python per step: zero_grad, microbatch split, loss stack, ...
    optimizer_step_ms: NonNegFloat = 0.0  # fixed cost of one optimizer.step() call
    optimizer_tensor_ms: NonNegFloat = 0.0  # ... plus this per parameter tensor
    optimizer_bytes_per_s: NonNegFloat = (
        0.0  # ... plus streaming weight, gradient and state; 0: free
    )
    rank_speed: NonNegFloat = (
        1.0  # share of a core each rank's Python and kernels get (``shared_cores``)
    )
    oversubscribed_rate: NonNegFloat = (
        1.0  # work a core does while ranks outnumber cores (Note [processor sharing])
    )
    recompute_fwd_ms: NonNegFloat = 0.0  # a recomputing stage's F: entering its checkpoint region
    recompute_bwd_ms: NonNegFloat = (
        0.0  # ... its B: rebuilding the region's graph (Note [recompute cost])
    )
    recompute_fwd_saved_ms: NonNegFloat = 0.0  # ... F, per tensor the stage saves for backward
    recompute_bwd_saved_ms: NonNegFloat = 0.0  # ... B, per tensor the stage saves for backward
    tp_pair_fwd_ms: NonNegFloat = 0.0  # a split tp pair's runtime cost per microbatch, forward
    tp_pair_bwd_ms: NonNegFloat = 0.0  # ... backward (Note [tensor-parallel runtime cost])
    step_receives: bool = (
        False  # receives posted at step start (gloo; Notes [step prediction], [memory over time])
    )
    workspace_bytes: NonNegInt = (
        0  # per rank, allocated by the device's libraries, not the model (cuBLAS workspaces)
    )
    host_slowdown: NonNegFloat = (
        1.0  # the CPU costs above are priced at this host's speed (``at_host_speed``)
    )
    step_resolution: NonNegFloat = (
        0.0  # predicted steps of two splits this close (relative) are not told apart
    )
    # (Note [planning for step time])

    def __post_init__(self) -> None:
        if not self.rank_speed > 0:
            raise PartitionError(
                f"rank_speed must be > 0 (a share of a core), got {self.rank_speed}"
            )
        if not 0 < self.oversubscribed_rate <= 1:
            raise PartitionError(
                f"oversubscribed_rate must be in (0, 1], got {self.oversubscribed_rate}"
            )
        if not self.host_slowdown > 0:
            raise PartitionError(f"host_slowdown must be > 0, got {self.host_slowdown}")

    @property
    def busy_speed(self) -> float:
        """A rank's speed while every rank computes: its share of a core, less the switching
        cost where the ranks outnumber the cores (Note [shared cores])."""
        return self.rank_speed * (self.oversubscribed_rate if self.rank_speed < 1 else 1.0)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


# The fields that are CPU work on the rank's host, and so take longer on a slower one. Not the
# gloo stalls (time slices of the OS scheduler) nor the ratios and sizes.
_HOST_WORK_MS = (
    "action_ms",
    "split_ms",
    "split_unit_ms",
    "weight_call_ms",
    "message_ms",
    "dp_sync_ms",
    "dp_sync_tensor_ms",
    "collective_ms",
    "loss_ms",
    "step_ms",
    "optimizer_step_ms",
    "optimizer_tensor_ms",
    "recompute_fwd_ms",
    "recompute_bwd_ms",
    "recompute_fwd_saved_ms",
    "recompute_bwd_saved_ms",
    "tp_pair_fwd_ms",
    "tp_pair_bwd_ms",
)


def at_host_speed(runtime: RuntimeCosts, slowdown: float) -> RuntimeCosts:
    """``runtime``, calibrated at its host's quiet speed, on a host ``slowdown`` times slower
    (``ModelProfile.host_slowdown``, Note [host speed] in :mod:`fxpipe.tracer.measure.calibration`):
    its CPU work takes ``slowdown`` times as long, the optimizer streams bytes that much slower.

    >>> at_host_speed(RuntimeCosts(step_ms=0.25), 2.0).step_ms
    0.5
    """
    if not slowdown > 0:
        raise PartitionError(f"a host's slowdown must be > 0, got {slowdown}")
    scale = slowdown / runtime.host_slowdown
    fields = {name: getattr(runtime, name) * scale for name in _HOST_WORK_MS}
    return replace(
        runtime,
        **fields,
        optimizer_bytes_per_s=runtime.optimizer_bytes_per_s / scale,
        host_slowdown=slowdown,
    )


def shared_cores(runtime: RuntimeCosts, processes: int, cores: int) -> RuntimeCosts:
    """``runtime`` on a host where ``processes`` ranks share ``cores`` cores (Note [shared cores]).

    >>> shared_cores(RuntimeCosts(), processes=4, cores=2).rank_speed
    0.5
    """
    if processes < 1 or cores < 1:
        raise PartitionError(f"processes and cores must be >= 1, got {processes} and {cores}")
    return replace(runtime, rank_speed=min(1.0, cores / processes))


# Per trace device, from calibration.json (Note [calibration data] in fxpipe.calibration_data).
# Link times are not here: the CostModel prices them (its link presets).
RUNTIME_COSTS: dict[str, RuntimeCosts] = {
    name: RuntimeCosts(**values("runtime_costs", name)) for name in names("runtime_costs")
}


def runtime_costs_for(device: str, host_slowdown: float = 1.0) -> RuntimeCosts:
    """The runtime costs a profile priced for ``device`` (its ``trace_device``) is planned with,
    at the speed of the host it was measured on (``ModelProfile.host_slowdown``); the CPU's
    for a device without its own entry."""
    runtime = RUNTIME_COSTS.get(device, RUNTIME_COSTS["cpu"])
    return runtime if host_slowdown == 1.0 else at_host_speed(runtime, host_slowdown)


@dataclass(frozen=True)
class StepOverheads:
    """Milliseconds a step spends after the pipeline drains (Note [step prediction])."""

    tied_all_reduce_ms: NonNegFloat = 0.0  # all-reduces of parameters held by several stages
    loss_broadcast_ms: NonNegFloat = 0.0  # the loss, from the last stage to the others
    optimizer_ms: NonNegFloat = 0.0  # the slowest stage's zero_grad + optimizer step
    dp_all_reduce_ms: NonNegFloat = (
        0.0  # the slowest stage's data-parallel sync: all-reduce + DDP's pass, or sharded
    )
    fixed_ms: NonNegFloat = 0.0  # RuntimeCosts.step_ms

    @property
    def total_ms(self) -> float:
        return (
            self.tied_all_reduce_ms
            + self.loss_broadcast_ms
            + self.optimizer_ms
            + self.dp_all_reduce_ms
            + self.fixed_ms
        )


@dataclass(frozen=True)
class Prediction:
    """A split's predicted step under every schedule it can run (``predicted_schedules``).

    Per schedule: ``step_ms`` (the whole step) = ``pipeline_ms`` (the simulated forward and
    backward part) + ``step_overhead_ms.total_ms``; ``bubble_by_schedule`` the idle share of
    the pipeline part; ``peak_memory_bytes_by_schedule`` each rank's peak memory. The
    properties answer for ``schedule``, the plan's own. ``runtime_costs`` are the fixed
    runtime costs the prediction assumed.
    """

    schedule: str
    step_ms: dict[str, NonNegFloat]
    pipeline_ms: dict[str, NonNegFloat]
    bubble_by_schedule: dict[str, NonNegFloat]
    peak_memory_bytes_by_schedule: dict[str, tuple[NonNegInt, ...]]
    step_overhead_ms: StepOverheads
    runtime_costs: RuntimeCosts
    samples_per_step: NonNegInt

    def __post_init__(self) -> None:
        for name in (
            "step_ms",
            "pipeline_ms",
            "bubble_by_schedule",
            "peak_memory_bytes_by_schedule",
        ):
            if self.schedule not in getattr(self, name):
                raise PartitionError(
                    f"prediction {name} has no entry for its schedule {self.schedule!r}"
                )

    @property
    def bubble(self) -> float:
        return self.bubble_by_schedule[self.schedule]

    @property
    def peak_memory_bytes(self) -> tuple[int, ...]:
        return self.peak_memory_bytes_by_schedule[self.schedule]

    @property
    def throughput_samples_per_s(self) -> float:
        step = self.step_ms[self.schedule]
        return self.samples_per_step / (step / 1e3) if step > 0 else float("inf")


def predicted_schedules(problem: PartitionProblem) -> tuple[str, ...]:
    """The schedules a split of ``problem`` can run (its placement's), the problem's own first."""
    names = runnable_schedules(problem.virtual_stages, problem.placement)
    return (problem.schedule,) + tuple(n for n in names if n != problem.schedule)


def _messages(
    problem: PartitionProblem, assignment: tuple[int, ...]
) -> tuple[
    list[int], list[int], list[int], list[int], dict[tuple[int, int], tuple[bool, float, float]]
]:
    """Per microbatch: messages each stage handles (sends and receives) in forward and in
    backward, and of them those it receives in forward and in backward; per link (a, d)
    between stages of different ranks: whether gradients come back, the link time of the
    activations stage d receives (from all its producers) and of the gradients stage a
    receives (Note [step prediction]; summed per receiver, as the runtime waits for them all)."""
    S, ranks = problem.num_stages, problem.stage_ranks
    n_fwd, n_bwd = [0] * S, [0] * S
    fwd_bytes, bwd_bytes = (
        [0] * S,
        [0] * S,
    )  # received by stage (activations) / by stage (gradients)
    fwd_msgs, bwd_msgs = [0] * S, [0] * S
    pairs: dict[tuple[int, int], bool] = {}
    for t in problem.tensors:
        a = assignment[t.producer]
        for d in {assignment[c] for c in t.consumers} - {a}:
            pairs[(a, d)] = pairs.get((a, d), False) or t.requires_grad
            if ranks[a] == ranks[d]:
                continue
            n_fwd[a] += 1
            n_fwd[d] += 1
            fwd_bytes[d] += problem.cost.wire_bytes(t.nbytes)
            fwd_msgs[d] += 1
            if t.requires_grad:
                n_bwd[a] += 1
                n_bwd[d] += 1
                bwd_bytes[a] += problem.cost.wire_bytes(t.nbytes)
                bwd_msgs[a] += 1
    cost = problem.cost

    def link(nbytes: int, count: int, a: int, d: int) -> float:
        return cost.p2p_ms(nbytes, ranks[a], ranks[d], problem.num_ranks) if count else 0.0

    for s in range(
        S - 1
    ):  # a pipeline: each stage follows the one before (also when no tensor is profiled)
        pairs.setdefault((s, s + 1), True)
    links = {
        (a, d): (grad, 0.0, 0.0)
        if ranks[a] == ranks[d]
        else (grad, link(fwd_bytes[d], fwd_msgs[d], a, d), link(bwd_bytes[a], bwd_msgs[a], a, d))
        for (a, d), grad in pairs.items()
    }
    return n_fwd, n_bwd, fwd_msgs, bwd_msgs, links


def _stages_with_input_grads(problem: PartitionProblem, assignment: tuple[int, ...]) -> list[bool]:
    """Whether each stage receives a tensor that needs a gradient (its split ``B`` has input-gradient work)."""
    out = [False] * problem.num_stages
    for t in problem.tensors:
        if t.requires_grad:
            a = assignment[t.producer]
            for c in t.consumers:
                if assignment[c] != a:
                    out[assignment[c]] = True
    return out


def step_overheads(
    problem: PartitionProblem, assignment: tuple[int, ...], runtime: RuntimeCosts
) -> StepOverheads:
    """What a step spends after the pipeline drains (Note [step prediction]):
    all-reduces of parameters tied across ranks, the loss broadcast, the slowest rank's
    optimizer step, the slowest rank's data-parallel gradient all-reduce
    (``CostModel.allreduce_ms``) with DDP's pass around it (Note [data-parallel sync
    cost]), fixed Python."""
    ranks_of: dict[int, set[int]] = {}
    for u, s in enumerate(assignment):
        for p in problem.unit_params[u]:
            ranks_of.setdefault(p, set()).add(problem.stage_ranks[s])
    collective = runtime.collective_ms / runtime.busy_speed  # CPU and wake-ups: shared like compute
    tied = sum(
        2 * (len(rs) - 1) * (problem.cost.message_ms(problem.param_bytes[p]) + collective)
        for p, rs in ranks_of.items()
        if len(rs) > 1
    )
    broadcast = problem.cost.message_ms(_LOSS_BYTES) + collective if problem.num_ranks > 1 else 0.0
    touched = (
        3 + 2 * problem.cost.optimizer_factor
    )  # read weight and gradient, write weight; state in and out
    params_of: dict[int, list[int]] = {}
    for p, rs in ranks_of.items():
        for r in rs:
            params_of.setdefault(r, []).append(p)
    optimizer = dp_all_reduce = 0.0
    for r in range(problem.num_ranks):
        mine = params_of.get(r, [])
        sync_pass = (
            (runtime.dp_sync_ms + len(mine) * runtime.dp_sync_tensor_ms) / runtime.busy_speed
            if problem.cost.ddp_synced and mine
            else 0.0
        )  # Note [data-parallel sync cost]
        dp_all_reduce = max(
            dp_all_reduce,
            problem.dp_allreduce_ms(mine) + problem.dp_hops(mine) * collective + sync_pass,
        )
        nbytes = (
            sum(problem.param_bytes[p] for p in mine) / problem.cost.optimizer_shards
        )  # sharded: its share
        stream = (
            touched * nbytes / runtime.optimizer_bytes_per_s * 1e3
            if runtime.optimizer_bytes_per_s > 0
            else 0.0
        )
        if mine:
            optimizer = max(
                optimizer,
                runtime.optimizer_step_ms + len(mine) * runtime.optimizer_tensor_ms + stream,
            )
    return StepOverheads(
        tied_all_reduce_ms=float(tied),
        loss_broadcast_ms=broadcast,
        optimizer_ms=optimizer / runtime.busy_speed,
        dp_all_reduce_ms=dp_all_reduce,
        fixed_ms=runtime.step_ms / runtime.busy_speed,
    )


def simulate_plan(
    problem: PartitionProblem,
    assignment: tuple[int, ...],
    runtime: RuntimeCosts,
    schedule: str | None = None,
    evaluation: Evaluation | None = None,
) -> Timeline:
    """The simulated pipeline part of one step of ``assignment`` under ``schedule`` (default the
    problem's), with the runtime's per-action and per-message costs (Note [step prediction])."""
    name = schedule or problem.schedule
    ev = (
        evaluation if evaluation is not None else evaluate(problem, assignment)
    )  # times do not depend on it
    n_fwd, n_bwd, recv_fwd, recv_bwd, links = _messages(problem, assignment)
    last = problem.num_stages - 1
    rt = runtime
    plan = make_schedule(name, problem.num_ranks, problem.microbatches, problem.virtual_stages)
    split = plan.split_backward()
    loss = [rt.loss_ms / 2 if s == last else 0.0 for s in range(problem.num_stages)]
    units, weighted, saved = (
        [0] * problem.num_stages,
        [0] * problem.num_stages,
        [0] * problem.num_stages,
    )
    for u, s in enumerate(assignment):
        units[s] += 1
        weighted[s] += bool(problem.unit_params[u])
        saved[s] += problem.saved_tensors[u] if problem.saved_tensors else 0
    recompute = problem.cost.recomputes(problem.num_stages)  # Note [recompute cost]
    region_f = [
        rt.recompute_fwd_ms + n * rt.recompute_fwd_saved_ms if r else 0.0
        for n, r in zip(saved, recompute)
    ]
    region_b = [
        rt.recompute_bwd_ms + n * rt.recompute_bwd_saved_ms if r else 0.0
        for n, r in zip(saved, recompute)
    ]
    # messages each action posts itself: all of them, or only its sends where every receive of the
    # step is posted when the step starts, the rank's prologue (Note [step prediction])
    at_fwd = [n - r for n, r in zip(n_fwd, recv_fwd)] if rt.step_receives else n_fwd
    at_bwd = [n - r for n, r in zip(n_bwd, recv_bwd)] if rt.step_receives else n_bwd
    fwd = [
        st.fwd_ms + rt.action_ms + at_fwd[s] * rt.message_ms + loss[s] + region_f[s]
        for s, st in enumerate(ev.stages)
    ]
    bwd = [
        st.bwd_ms + rt.action_ms + at_bwd[s] * rt.message_ms + loss[s] + region_b[s]
        for s, st in enumerate(ev.stages)
    ]
    graded = _stages_with_input_grads(problem, assignment)
    f = rt.split_factor
    b_in = [
        b
        - st.bwd_ms
        + (st.bwd_ms - st.bwd_weight_ms) * f
        + rt.split_ms
        + units[s] * rt.split_unit_ms
        if graded[s]
        else rt.action_ms + at_bwd[s] * rt.message_ms + loss[s] + rt.split_ms
        for s, (b, st) in enumerate(zip(bwd, ev.stages))
    ]
    w = [
        st.bwd_weight_ms * f + rt.action_ms + weighted[s] * rt.weight_call_ms
        if graded[s]
        else st.bwd_ms
        + rt.action_ms  # the whole backward in one engine call (split_backward.SplitBackward.inputs)
        for s, st in enumerate(ev.stages)
    ]
    posting = (
        [
            rt.message_ms
            * sum(
                recv_fwd[a.stage] if a.kind is ActionKind.FORWARD else recv_bwd[a.stage]
                for a in acts
                if a.kind is not ActionKind.WEIGHT
            )
            for acts in plan.actions
        ]
        if rt.step_receives
        else []
    )

    def duration(a: Action) -> float:
        if a.kind is ActionKind.FORWARD:
            return fwd[a.stage]
        if a.kind is ActionKind.WEIGHT:
            return w[a.stage]
        return b_in[a.stage] if (a.stage, a.microbatch) in split else bwd[a.stage]

    def delay(link: Link, kind: ActionKind) -> float:
        _, act, grad = links[(link.src, link.dst)]
        return act if kind is ActionKind.FORWARD else grad

    def stall(a: Action) -> float:  # Note [message stalls]
        if a.kind is ActionKind.WEIGHT:
            return 0.0
        return (n_fwd if a.kind is ActionKind.FORWARD else n_bwd)[a.stage] * rt.message_stall_ms

    shared = (
        rt.rank_speed * problem.num_ranks if rt.rank_speed < 1 else None
    )  # cores of this pipeline's ranks
    return simulate_step(
        plan,
        duration,
        links=[Link(a, d, g) for (a, d), (g, _, _) in sorted(links.items())],
        delay=delay,
        cores=shared,
        oversubscribed_rate=rt.oversubscribed_rate,
        stall=stall if rt.message_stall_ms > 0 else None,
        prologue=posting,
    )


@dataclass(frozen=True)
class StageBytes:
    """Bytes per microbatch of what one stage holds (Note [memory over time]), from the profile."""

    activations: int = 0  # saved for backward per microbatch (0 where the stage recomputes)
    outputs_sent: int = 0  # one microbatch's output messages to other ranks
    grads_sent: int = 0  # one microbatch's input-gradient messages
    weight_pending: int = 0  # gradients a split B keeps for its W
    backward_temporary: int = (
        0  # alive while B runs: gradients of the widest unit's output and input
    )
    weight_temporary: int = 0  # alive while W runs (a stage whose split B makes no input gradient)
    grads: int = 0  # the stage's parameter gradients (once they exist)
    activation_buffer: int = 0  # one receive buffer of the stage's inputs
    gradient_buffer: int = 0  # one receive buffer of its output gradients

    def per_count(self) -> tuple[int, ...]:
        """Bytes per unit of each ``Holding`` count, in its field order (receive buffers excluded)."""
        return (
            self.activations,
            self.outputs_sent,
            self.grads_sent,
            self.weight_pending,
            self.backward_temporary,
            self.weight_temporary,
            self.grads,
        )


def stage_bytes(problem: PartitionProblem, assignment: tuple[int, ...]) -> list[StageBytes]:
    """Per stage, the byte sizes Note [memory over time] multiplies by the schedule's counts.

    Backward temporaries: while a unit runs backward, the gradient of its output and the
    one it makes for its input are alive together, and a weight's gradient is made whole
    before it is added into ``.grad``; taken as twice the widest unit output of the stage
    (its outputs' bytes) plus its largest parameter (``W`` alone: the parameter). A recomputing stage saves nothing between F and B
    and rebuilds one microbatch's activations in B. Gradients kept for W: the gradient of
    every unit output whose unit has parameters or weight-gradient work (what the weight
    gradients start from). A stage that makes no input gradient (none of the tensors it
    receives, from any other stage, needs one: ``_stages_with_input_grads``, as the step
    simulation prices it) runs its whole split backward in ``W``.
    """
    S, ranks = problem.num_stages, problem.stage_ranks
    outputs = problem.output_bytes or (0,) * problem.num_units
    weight_w = problem.bwd_weight_ms or (0.0,) * problem.num_units
    act, widest, pending, param = [0] * S, [0] * S, [0] * S, [0] * S
    params: list[set[int]] = [set() for _ in range(S)]
    for u, s in enumerate(assignment):
        params[s].update(problem.unit_params[u])
        act[s] += problem.activation_bytes[u]
        param[s] = max([param[s]] + [problem.param_bytes[p] for p in problem.unit_params[u]])
        widest[s] = max(widest[s], outputs[u])
        if problem.unit_params[u] or weight_w[u] > 0:
            pending[s] += outputs[u]
    sent, sent_grad, recv, recv_grad = [0] * S, [0] * S, [0] * S, [0] * S
    for t in problem.tensors:
        a = assignment[t.producer]
        for d in {assignment[c] for c in t.consumers} - {a}:
            if ranks[a] == ranks[d]:
                continue
            sent[a] += t.nbytes
            recv[d] += t.nbytes
            if t.requires_grad:
                sent_grad[a] += t.nbytes
                recv_grad[d] += t.nbytes
    recompute = problem.cost.recomputes(S)
    graded = _stages_with_input_grads(problem, assignment)
    out = []
    for s in range(S):
        temporary = 2 * widest[s] + param[s] + (act[s] if recompute[s] else 0)
        makes_input_grads = graded[s]
        out.append(
            StageBytes(
                activations=0 if recompute[s] else act[s],
                outputs_sent=sent[s],
                grads_sent=recv_grad[s],
                weight_pending=pending[s] if makes_input_grads else 0,
                backward_temporary=temporary,
                weight_temporary=param[s] if makes_input_grads else temporary,
                grads=problem.cost.stage_state_bytes(
                    sum(problem.param_bytes[p] for p in params[s])
                )[1],
                activation_buffer=recv[s],
                gradient_buffer=sent_grad[s],
            )
        )
    return out


def rank_peak_memory(
    problem: PartitionProblem,
    assignment: tuple[int, ...],
    schedule: str | None = None,
    runtime: RuntimeCosts | None = None,
) -> tuple[int, ...]:
    """Each rank's peak tensor bytes over one step under ``schedule`` (Note [memory over time]):
    training state of its distinct parameters, buffers, the step's inputs (every rank is handed
    the batch), the receive-buffer pools (as ``runtime`` posts receives; default
    ``RUNTIME_COSTS["cpu"]``), the device libraries' workspaces, and the largest moment of the
    schedule's walk."""
    rt = runtime if runtime is not None else RUNTIME_COSTS["cpu"]
    step_receives, workspace = rt.step_receives, rt.workspace_bytes
    name = schedule or problem.schedule
    sizes = stage_bytes(problem, assignment)
    fixed, held = _rank_fixed_and_params(problem, assignment)
    out = []
    moments = schedule_memory_moments(
        name, problem.num_ranks, problem.virtual_stages, problem.microbatches, step_receives
    )
    for r, rank in enumerate(moments):
        weights, _, optimizer = problem.cost.stage_state_bytes(held[r])
        state = weights + optimizer  # gradients: per stage, at the moments they exist
        pools = sum(
            na * sizes[s].activation_buffer + ng * sizes[s].gradient_buffer
            for s, na, ng in zip(rank.stages, rank.activation_buffers, rank.gradient_buffers)
        )
        peak = rank.peak([sizes[s].per_count() for s in rank.stages])
        out.append(int(fixed[r] + state + pools + peak) + workspace)
    return tuple(out)


@dataclass(frozen=True)
class MemoryFloor:
    """Per rank, bytes its schedule walk holds at some moment under every schedule
    (``rank_memory_floor``): bounds on ``rank_peak_memory`` from below, cheap to compute."""

    always: tuple[int, ...]  # at every moment: weights, optimizer state, buffers, the step's inputs
    at_end: tuple[int, ...]  # when the step ends: that, plus the gradients of every stage
    activations: tuple[
        int, ...
    ]  # beside ``always`` once: the most in-flight activations a stage keeps ...
    recomputed: tuple[
        int, ...
    ]  # ... or, where the stages recompute, one microbatch's, rebuilt in B


def rank_memory_floor(
    problem: PartitionProblem, assignment: tuple[int, ...], runtime: RuntimeCosts | None = None
) -> MemoryFloor:
    """Lower bounds on each rank's walked peak (Note [memory over time]) that need no walk: sums
    over the units. The walk's last moment holds ``at_end``; the moment a stage's in-flight count
    peaks holds ``always`` plus its activations (one microbatch's during a recomputing B). The
    cluster search rejects or recomputes on them before walking (Note [cluster search]).
    ``runtime`` (default ``RUNTIME_COSTS["cpu"]``): whose library workspaces ``always`` includes."""
    workspace = (runtime if runtime is not None else RUNTIME_COSTS["cpu"]).workspace_bytes
    fixed, held = _rank_fixed_and_params(problem, assignment)
    S, R = problem.num_stages, problem.num_ranks
    stage_params: list[set[int]] = [set() for _ in range(S)]
    act = [0] * S
    for u, s in enumerate(assignment):
        stage_params[s].update(problem.unit_params[u])
        act[s] += problem.activation_bytes[u]
    grads, kept, rebuilt = [0] * R, [0] * R, [0] * R
    for s, ps in enumerate(stage_params):  # gradients per stage, as the walk counts them
        r = problem.stage_ranks[s]
        grads[r] += problem.cost.stage_state_bytes(sum(problem.param_bytes[p] for p in ps))[1]
        kept[r] = max(kept[r], act[s] * problem.in_flight(s))
        rebuilt[r] = max(rebuilt[r], act[s])
    always = []
    for f, h in zip(fixed, held):
        weights, _, optimizer = problem.cost.stage_state_bytes(h)
        always.append(int(f + weights + optimizer) + workspace)
    return MemoryFloor(
        always=tuple(always),
        at_end=tuple(a + g for a, g in zip(always, grads)),
        activations=tuple(kept),
        recomputed=tuple(rebuilt),
    )


def _rank_fixed_and_params(
    problem: PartitionProblem, assignment: tuple[int, ...]
) -> tuple[list[int], list[int]]:
    """Per rank: bytes held whatever the schedule (its buffers, the step's inputs: every rank
    is handed the batch), and bytes of the distinct parameters it holds."""
    rank_params: list[set[int]] = [set() for _ in range(problem.num_ranks)]
    fixed = [problem.input_bytes * problem.microbatches] * problem.num_ranks
    for u, s in enumerate(assignment):
        r = problem.stage_ranks[s]
        rank_params[r].update(problem.unit_params[u])
        fixed[r] += problem.buffer_bytes[u]
    return fixed, [sum(problem.param_bytes[p] for p in ps) for ps in rank_params]


def predict(
    problem: PartitionProblem,
    assignment: tuple[int, ...],
    microbatch_size: int,
    *,
    runtime: RuntimeCosts | None = None,
) -> Prediction:
    """Step time under every schedule the split can run (simulated, plus per-step overheads),
    bubble, throughput and per-rank peak memory (Note [step prediction]).

    ``runtime`` defaults to ``RUNTIME_COSTS["cpu"]``.
    """
    rt = runtime if runtime is not None else RUNTIME_COSTS["cpu"]
    overhead = step_overheads(problem, assignment, rt)
    step_ms: dict[str, float] = {}
    pipeline_ms: dict[str, float] = {}
    bubble: dict[str, float] = {}
    memory: dict[str, tuple[int, ...]] = {}
    for schedule in predicted_schedules(problem):
        ev = evaluate(replace(problem, schedule=schedule), assignment)
        line = simulate_plan(problem, assignment, rt, schedule, ev)
        pipeline_ms[schedule] = line.step_ms
        step_ms[schedule] = line.step_ms + overhead.total_ms
        bubble[schedule] = line.bubble
        memory[schedule] = rank_peak_memory(problem, assignment, schedule, rt)
    return Prediction(
        schedule=problem.schedule,
        step_ms=step_ms,
        pipeline_ms=pipeline_ms,
        bubble_by_schedule=bubble,
        peak_memory_bytes_by_schedule=memory,
        step_overhead_ms=overhead,
        runtime_costs=rt,
        samples_per_step=problem.microbatches * microbatch_size,
    )
