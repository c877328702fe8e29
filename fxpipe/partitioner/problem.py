"""The partitioning problem as plain arrays, and the exact cost of one assignment.

Note [stage cost]: every solver, baseline and report is judged by ``evaluate`` below.

* A *tensor* is one output of one unit, ``(producer, output index)``. It is sent once
  from the producer's stage to every *other* stage that holds a consumer (a skip
  connection into stages b and c is two messages, one straight to each); stages in
  between do not touch it. Each message costs ``bytes / link_bandwidth +
  link_latency`` on the sender AND on the receiver. In backward the gradient goes the
  other way, for tensors whose ``TensorSpec.requires_grad``. Model inputs travel on no
  edge (Note [model inputs] in ``fxpipe.tracer.profile``).
* Stages are the build's chunks: ``num_stages`` = ranks x ``virtual_stages``, placed on
  the ranks ``loop``- or ``v``-style (``stage_ranks``). Stages on the same rank hand
  tensors over in memory: no message, no time, no buffer.
* Stage time = (fwd + bwd compute of its units) / device speed + its message times.
  A stage that recomputes (``cost.recompute``, Note [recompute cost] in ``prediction``) adds its
  forward to its backward and holds its activations for one microbatch instead of k
  (its received inputs stay held for all k, as the boundary buffers below say).
* Stage memory = distinct parameters used by its units (a tied parameter on every
  stage that uses it) x (1 + 1 for gradients + optimizer factor) + buffers
  + activation bytes x microbatches in flight + boundary buffers: received inputs x
  microbatches in flight k (kept for backward), plus sent outputs x M and the input
  gradients sent back (received tensors that require grad) x (M - k + 1), because the
  runtime keeps every posted send alive until the step ends (``runtime.stage_io``;
  measured with ``runtime.memory.TensorMemoryTracker``). Gradients: at the peak, while
  k inputs are still held, both schedules have posted the gradients of M - k
  microbatches and are making one more (1F1B last stage: all M; GPipe: 1). In flight
  k: the most microbatches the stage holds between its ``F`` and its last backward
  action under the schedule's action lists (``schedule.in_flight_per_stage``: GPipe all
  M, 1F1B ``min(M, S - i)``, ZB-H1 ``min(M, S)``); M is ``PartitionProblem.microbatches``.
* The prediction's per-rank peak (``prediction.rank_peak_memory``, in
  ``Prediction.peak_memory_bytes_by_schedule``) walks the schedule's actions instead
  (Note [memory over time] in ``schedule.memory``) and adds what this linear formula,
  which the solvers constrain, leaves out: backward temporaries, gradients kept for a
  split ``W``, receive buffers (on gloo one per message of the step), the step's inputs, and gradients
  only once they exist; this linear formula is below that walk wherever it leaves those out.
* Rank memory (what a memory limit bounds) = the distinct parameters of its stages
  (a tied parameter shared by two stages of one rank counts once) x state + the sum of
  its stages' buffers, activations and boundary buffers (each at its own peak: an
  upper bound when a rank's stages peak at different times).
* Data parallelism (``cost.dp_replicas`` > 1): each stage's distinct parameters are
  all-reduced once per step (``PartitionProblem.dp_allreduce_ms``: the cost model's
  ``allreduce_ms`` with the parameters' shapes, Note [hook pricing]), or gathered and
  reduce-scattered as ``cost.shard`` says (Note [sharding pricing], which also divides
  the parameter, gradient and optimizer bytes per rank), reported as
  ``StageCost.dp_allreduce_ms`` and ``dp_bytes``. It is not part of the per-microbatch ``stage_ms`` the
  solvers balance (it is paid once per step, not per microbatch); the predicted step
  time adds the largest one (``planner.predict``).

Note [random order]: a unit that draws random numbers (dropout; ``Unit.random``) must not
run on an earlier stage than one that draws them before it in the program: the chained
stages then consume the random stream in the original order, so a pipeline and the model
give the same values from the same seed. Contiguous splits keep it by construction; CP-SAT
gets it as a constraint, and ``assignment_violations`` checks it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fxpipe.errors import PartitionError, PinError
from fxpipe.errors import ScheduleError
from fxpipe.partitioner.cost import CostModel
from fxpipe.partitioner.schedule import SCHEDULE_NAMES, compatible, schedule_kind, stage_ranks
from fxpipe.partitioner.schedule.occupancy import schedule_in_flight
from fxpipe.tracer.profile import ModelProfile

__all__ = [
    "Tensor",
    "PartitionProblem",
    "StageCost",
    "Evaluation",
    "build_problem",
    "evaluate",
    "assignment_violations",
    "in_flight",
]


@dataclass(frozen=True)
class Tensor:
    """One unit output that some later unit reads: who makes it, who reads it, its size."""

    producer: int
    consumers: tuple[int, ...]
    nbytes: int
    requires_grad: bool = True


@dataclass(frozen=True)
class PartitionProblem:
    """A profile flattened into index-based arrays for the solvers (units in topological order)."""

    names: tuple[str, ...]
    module_paths: tuple[str, ...]
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    buffer_bytes: tuple[int, ...]
    unit_params: tuple[tuple[int, ...], ...]  # indices into param_bytes
    param_bytes: tuple[int, ...]  # size of each distinct parameter
    param_names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    pins: tuple[int | None, ...]
    num_stages: int
    schedule: str = "1f1b"
    microbatches: int = 1
    cost: CostModel = CostModel()
    memory_limit: int | None = None
    param_shapes: tuple[tuple[int, ...] | None, ...] = ()  # per param_bytes entry; None: unknown
    random_units: tuple[
        int, ...
    ] = ()  # units that draw random numbers, in program order (Note [random order])
    bwd_weight_ms: tuple[float, ...] = ()  # of bwd_ms, the weight gradients (a split W); () = none
    virtual_stages: int = 1  # stages (chunks) per rank
    placement: str = "loop"  # how the chunks sit on the ranks (schedule.placement)
    output_bytes: tuple[
        int, ...
    ] = ()  # per unit, its outputs' bytes per microbatch; () = unknown (0)
    input_bytes: int = 0  # the model's inputs per microbatch (Note [memory over time])
    saved_tensors: tuple[
        int, ...
    ] = ()  # per unit, tensors saved for backward per forward; () = unknown (0)

    @property
    def num_units(self) -> int:
        return len(self.names)

    @property
    def num_ranks(self) -> int:
        return self.num_stages // self.virtual_stages

    @functools.cached_property
    def stage_ranks(self) -> tuple[int, ...]:
        """The rank of every stage (chunk)."""
        return stage_ranks(self.num_ranks, self.virtual_stages, self.placement)

    def cut_factors(self, stage: int) -> tuple[float, float]:
        """(1 or 0, 1 or 0): whether ``stage``'s first and last boundary in the topological
        order are crossed by messages (0 where the neighbouring stage shares its rank)."""
        ranks = self.stage_ranks
        start = 0.0 if stage > 0 and ranks[stage - 1] == ranks[stage] else 1.0
        end = 0.0 if stage + 1 < self.num_stages and ranks[stage + 1] == ranks[stage] else 1.0
        return start, end

    @property
    def stage_memory_limit(self) -> float | None:
        """What one stage may use so that its rank fits ``memory_limit``: all of it with one stage per
        rank, else an even share (a sufficient condition the chain DP checks per stage)."""
        return None if self.memory_limit is None else self.memory_limit / self.virtual_stages

    def same_rank(self, a: int, b: int) -> bool:
        """Whether stages ``a`` and ``b`` run on one rank (they exchange no message)."""
        ranks = self.stage_ranks
        return ranks[a] == ranks[b]

    @property
    def speeds(self) -> tuple[float, ...]:
        return self.cost.speeds(self.num_stages)

    @property
    def is_chain(self) -> bool:
        """Every tensor is read only by the unit right after its producer."""
        return all(c == t.producer + 1 for t in self.tensors for c in t.consumers)

    @property
    def has_pins(self) -> bool:
        return any(p is not None for p in self.pins)

    def in_flight(self, stage: int) -> int:
        """Microbatches ``stage`` holds at its peak under the schedule's action lists (Note [stage cost])."""
        return schedule_in_flight(
            self.schedule, self.num_ranks, self.virtual_stages, self.microbatches
        )[stage]

    def activations_held(self, stage: int) -> int:
        """Microbatches whose activations ``stage`` keeps at its peak: 1 where it recomputes, else ``in_flight``."""
        return 1 if self.cost.recomputes(self.num_stages)[stage] else self.in_flight(stage)

    def grads_held(self, stage: int) -> int:
        """Input-gradient sends stage ``stage`` holds at its peak: ``M - in_flight + 1`` (Note [stage cost])."""
        return self.microbatches - self.in_flight(stage) + 1

    def dp_allreduce_ms(self, params: Iterable[int]) -> float:
        """Per-step data-parallel communication of these parameters (indices into ``param_bytes``):
        the gradient all-reduce, or the sharding level's collectives (Note [sharding pricing])."""
        mine = sorted(set(params))
        shapes = [self.param_shapes[p] if p < len(self.param_shapes) else None for p in mine]
        return self.cost.dp_comm_ms(
            [self.param_bytes[p] for p in mine], shapes, self.microbatches, self.num_ranks
        )

    def dp_hops(self, params: Iterable[int]) -> int:
        """Ring hops of the per-step data-parallel collectives of these parameters (``CostModel.dp_hops``)."""
        mine = sorted(set(params))
        shapes = [self.param_shapes[p] if p < len(self.param_shapes) else None for p in mine]
        return self.cost.dp_hops([self.param_bytes[p] for p in mine], shapes, self.microbatches)

    def dp_wire_bytes(self, params: Iterable[int]) -> float:
        """Bytes one rank sends per step on the data-parallel link for these parameters."""
        mine = sorted(set(params))
        shapes = [self.param_shapes[p] if p < len(self.param_shapes) else None for p in mine]
        traffic = self.cost.shard_traffic(
            [self.param_bytes[p] for p in mine], shapes, self.microbatches
        )
        return traffic.wire_bytes(self.cost.dp_replicas)

    @property
    def state_factor(self) -> float:
        """Bytes of training state per rank per parameter byte: the weight, its gradient, optimizer
        state (2 + optimizer factor, divided over the replicas as ``cost.shard`` says)."""
        return self.cost.state_factor


def in_flight(
    schedule: str, microbatches: int, num_stages: int, stage: int, virtual_stages: int = 1
) -> int:
    """Microbatches whose activations stage ``stage`` (of ``num_stages`` chunks) holds at its peak under ``schedule``."""
    return schedule_in_flight(schedule, num_stages // virtual_stages, virtual_stages, microbatches)[
        stage
    ]


def build_problem(
    profile: ModelProfile,
    num_stages: int,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    cost: CostModel | None = None,
    memory_limit: int | None = None,
    virtual_stages: int | None = None,
) -> PartitionProblem:
    """Flatten ``profile`` for ``num_stages`` ranks of ``virtual_stages`` stages each (default: the
    schedule's least), checking the request is well posed. The problem's stages are the chunks."""
    cost = cost or CostModel()
    n = len(profile.units)
    if schedule not in SCHEDULE_NAMES:
        raise PartitionError(
            f"unknown schedule {schedule!r}; expected one of {list(SCHEDULE_NAMES)}"
        )
    if microbatches < 1:
        raise PartitionError(f"microbatches must be >= 1, got {microbatches}")
    if num_stages < 1:
        raise PartitionError(f"num_stages must be >= 1, got {num_stages}")
    kind = schedule_kind(schedule)
    v = kind.default_virtual if virtual_stages is None else virtual_stages
    try:
        kind.check_virtual(v)
        schedule_in_flight(
            schedule, num_stages, v, microbatches
        )  # the schedule exists for these sizes
    except ScheduleError as exc:
        raise PartitionError(str(exc)) from None
    ranks, num_stages = num_stages, num_stages * v
    if num_stages > n:
        raise PartitionError(
            f"cannot split {n} units into {num_stages} stages"
            + (f" ({ranks} ranks x {v} virtual stages)" if v > 1 else "")
            + f": every stage needs at least one unit; use at most {n} stages or trace with finer units"
        )
    if memory_limit is not None and memory_limit <= 0:
        raise PartitionError(f"memory_limit must be a positive number of bytes, got {memory_limit}")
    cost.speeds(num_stages)
    if any(cost.recomputes(num_stages)) and kind.split_backward:
        raise PartitionError(
            f"schedule {schedule!r} splits the backward, which fxpipe does not combine with "
            "activation recomputation; use 1f1b, gpipe or interleaved-1f1b, or recompute no stage"
        )
    index = profile.unit_index
    pins = tuple(u.pin for u in profile.units)
    for u in profile.units:
        if u.pin is not None and u.pin >= num_stages:
            raise PinError(
                f"unit {u.name!r} is pinned to stage {u.pin} but there are only {num_stages} stages "
                f"(0..{num_stages - 1}); use at least {u.pin + 1} stages or change the pin"
            )
    unit_params, param_bytes, param_names = _params(profile)
    return PartitionProblem(
        names=tuple(u.name for u in profile.units),
        module_paths=tuple(u.module_path for u in profile.units),
        fwd_ms=tuple(float(u.fwd_ms) for u in profile.units),
        bwd_ms=tuple(float(u.bwd_ms) for u in profile.units),
        activation_bytes=tuple(int(u.activation_bytes) for u in profile.units),
        buffer_bytes=tuple(int(u.buffer_bytes) for u in profile.units),
        unit_params=unit_params,
        param_bytes=param_bytes,
        param_names=param_names,
        tensors=_tensors(profile, index),
        pins=pins,
        num_stages=num_stages,
        schedule=schedule,
        microbatches=microbatches,
        cost=cost,
        memory_limit=memory_limit,
        param_shapes=tuple(profile.param_shapes.get(name) for name in param_names),
        random_units=tuple(i for i, u in enumerate(profile.units) if u.random),
        bwd_weight_ms=tuple(float(u.bwd_weight_ms) for u in profile.units),
        virtual_stages=v,
        placement=kind.placement,
        output_bytes=tuple(int(u.output_bytes) for u in profile.units),
        input_bytes=sum(int(spec.nbytes) for spec in profile.inputs),
        saved_tensors=tuple(int(u.saved_tensors or 0) for u in profile.units),
    )


def _params(
    profile: ModelProfile,
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[str, ...]]:
    """Distinct parameters per unit. Tied names map to one parameter; a unit whose
    parameters the profile does not size is charged its ``param_bytes`` as a private one."""
    canonical: dict[str, str] = {}
    for group in profile.ties:
        for name in group:
            canonical[name] = group[0]
    ids: dict[str, int] = {}
    sizes: list[int] = []
    names: list[str] = []
    per_unit: list[tuple[int, ...]] = []
    for u in profile.units:
        keys = [canonical.get(p, p) for p in u.params]
        if keys and all(k in profile.param_sizes for k in keys):
            mine = []
            for k in dict.fromkeys(keys):
                if k not in ids:
                    ids[k] = len(sizes)
                    sizes.append(int(profile.param_sizes[k]))
                    names.append(k)
                mine.append(ids[k])
            per_unit.append(tuple(mine))
        elif u.param_bytes:
            sizes.append(int(u.param_bytes))
            names.append(f"{u.name}.*")
            per_unit.append((len(sizes) - 1,))
        else:
            per_unit.append(())
    return tuple(per_unit), tuple(sizes), tuple(names)


def _tensors(profile: ModelProfile, index: dict[str, int]) -> tuple[Tensor, ...]:
    """Group edges by (producer, output index); split an edge's bytes over its outputs."""
    found: dict[tuple[int, int], tuple[set[int], int, bool]] = {}
    for e in profile.edges:
        src = profile.units[index[e.src]]
        outs = e.outputs or (0,)
        specs = [src.outputs[o] if 0 <= o < len(src.outputs) else None for o in outs]
        spec_total = sum(s.nbytes for s in specs if s is not None)
        for o, spec in zip(outs, specs):
            if spec is not None and spec_total > 0 and all(s is not None for s in specs):
                nbytes = round(e.bytes * spec.nbytes / spec_total)
            else:
                nbytes = round(e.bytes / len(outs))
            grad = spec.requires_grad if spec is not None else True
            key = (index[e.src], o)
            consumers, old_bytes, old_grad = found.get(key, (set(), 0, False))
            consumers.add(index[e.dst])
            found[key] = (consumers, max(old_bytes, nbytes), old_grad or grad)
    return tuple(
        Tensor(producer=p, consumers=tuple(sorted(c)), nbytes=b, requires_grad=g)
        for (p, _), (c, b, g) in sorted(found.items())
    )


@dataclass(frozen=True)
class StageCost:
    """Time and memory of one stage under the cost model (per microbatch for times and bytes sent)."""

    fwd_ms: float
    bwd_ms: float
    comm_fwd_ms: float
    comm_bwd_ms: float
    send_bytes: int
    recv_bytes: int
    messages: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    activation_bytes: int
    boundary_bytes: int
    in_flight: int
    dp_allreduce_ms: float = 0.0  # per step, not per microbatch
    bwd_weight_ms: float = 0.0  # of bwd_ms, the weight gradients (what a split W computes)
    rank: int = 0  # the pipeline rank that runs this stage
    dp_bytes: float = 0.0  # bytes one rank sends per step on the data-parallel link

    @property
    def compute_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    @property
    def comm_ms(self) -> float:
        return self.comm_fwd_ms + self.comm_bwd_ms

    @property
    def stage_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    @property
    def memory_bytes(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.buffer_bytes
            + self.activation_bytes
            + self.boundary_bytes
        )


@dataclass(frozen=True)
class Evaluation:
    """The exact cost of one assignment: every stage, the bottleneck and the peak rank memory.

    ``rank_memory_bytes[r]``: rank r's memory (Note [stage cost]); with one stage per rank,
    each stage's ``memory_bytes``.
    """

    stages: tuple[StageCost, ...]
    rank_memory_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.rank_memory_bytes:
            object.__setattr__(
                self, "rank_memory_bytes", tuple(s.memory_bytes for s in self.stages)
            )

    @property
    def bottleneck_ms(self) -> float:
        return max(s.stage_ms for s in self.stages)

    @property
    def rank_ms(self) -> tuple[float, ...]:
        """Each rank's time per microbatch: the sum of its stages'."""
        out = [0.0] * len(self.rank_memory_bytes)
        for s in self.stages:
            out[s.rank] += s.stage_ms
        return tuple(out)

    @property
    def peak_memory_bytes(self) -> int:
        return max(self.rank_memory_bytes)


def evaluate(problem: PartitionProblem, assignment: Sequence[int]) -> Evaluation:
    """Cost of putting unit ``u`` on stage ``assignment[u]`` (Note [stage cost])."""
    S = problem.num_stages
    assert len(assignment) == problem.num_units, "one stage per unit"
    speeds = problem.speeds
    fwd = [0.0] * S
    bwd = [0.0] * S
    act = [0] * S
    buf = [0] * S
    params: list[set[int]] = [set() for _ in range(S)]
    wgt = [0.0] * S
    split_w = problem.bwd_weight_ms or (0.0,) * problem.num_units
    ranks = problem.stage_ranks
    for u, s in enumerate(assignment):
        fwd[s] += problem.fwd_ms[u]
        bwd[s] += problem.bwd_ms[u]
        wgt[s] += split_w[u]
        act[s] += problem.activation_bytes[u]
        buf[s] += problem.buffer_bytes[u]
        params[s].update(problem.unit_params[u])
    cf = [0.0] * S
    cb = [0.0] * S
    sent = [0] * S
    recv = [0] * S
    recv_grad = [0] * S  # received bytes whose gradient this stage sends back
    msgs = [0] * S
    for t in problem.tensors:
        a = assignment[t.producer]
        for d in {assignment[c] for c in t.consumers} - {a}:
            if ranks[d] == ranks[a]:
                continue  # handed over in memory on one rank
            nbytes = problem.cost.wire_bytes(t.nbytes)
            ms = problem.cost.p2p_ms(nbytes, ranks[a], ranks[d], problem.num_ranks)
            for s in (a, d):
                cf[s] += ms
                msgs[s] += 1
                if t.requires_grad:
                    cb[s] += ms
                    msgs[s] += 1
            sent[a] += nbytes
            recv[d] += nbytes
            if t.requires_grad:
                recv_grad[d] += nbytes
    stages = []
    recompute = problem.cost.recomputes(S)
    for s in range(S):
        pb = sum(problem.param_bytes[p] for p in params[s])
        state = problem.cost.stage_state_bytes(
            pb
        )  # per rank: sharding divides it (Note [sharding pricing])
        k = problem.in_flight(s)
        stages.append(
            StageCost(
                fwd_ms=fwd[s] / speeds[s],
                bwd_ms=(bwd[s] + (fwd[s] if recompute[s] else 0.0)) / speeds[s],
                comm_fwd_ms=cf[s],
                comm_bwd_ms=cb[s],
                send_bytes=sent[s],
                recv_bytes=recv[s],
                messages=msgs[s],
                param_bytes=state[0],
                grad_bytes=state[1],
                optimizer_bytes=state[2],
                buffer_bytes=buf[s],
                activation_bytes=act[s] * problem.activations_held(s),
                boundary_bytes=recv[s] * k
                + sent[s] * problem.microbatches
                + recv_grad[s] * problem.grads_held(s),
                in_flight=k,
                dp_allreduce_ms=problem.dp_allreduce_ms(params[s]),
                dp_bytes=problem.dp_wire_bytes(params[s]),
                bwd_weight_ms=wgt[s] / speeds[s],
                rank=ranks[s],
            )
        )
    if problem.virtual_stages == 1:
        return Evaluation(tuple(stages))
    rank_params: list[set[int]] = [set() for _ in range(problem.num_ranks)]
    rank_memory = [0] * problem.num_ranks
    for s, st in enumerate(stages):
        rank_params[ranks[s]].update(params[s])
        rank_memory[ranks[s]] += st.buffer_bytes + st.activation_bytes + st.boundary_bytes
    for r, ps in enumerate(rank_params):
        rank_memory[r] += int(
            round(sum(problem.cost.stage_state_bytes(sum(problem.param_bytes[p] for p in ps))))
        )
    return Evaluation(tuple(stages), tuple(rank_memory))


def assignment_violations(
    problem: PartitionProblem, assignment: Sequence[int], evaluation: Evaluation | None = None
) -> list[str]:
    """Why ``assignment`` is not a valid plan (empty list when it is): range, order, pins,
    empty stages, memory."""
    S = problem.num_stages
    out: list[str] = []
    if len(assignment) != problem.num_units:
        return [f"{len(assignment)} stages given for {problem.num_units} units"]
    for u, s in enumerate(assignment):
        if not 0 <= s < S:
            out.append(f"unit {problem.names[u]!r} on stage {s}, outside 0..{S - 1}")
        pin = problem.pins[u]
        if pin is not None and pin != s:
            out.append(f"unit {problem.names[u]!r} pinned to {pin} but on stage {s}")
    if out:
        return out
    for t in problem.tensors:
        for c in t.consumers:
            if assignment[c] < assignment[t.producer]:
                out.append(
                    f"{problem.names[t.producer]!r} (stage {assignment[t.producer]}) feeds "
                    f"{problem.names[c]!r} on earlier stage {assignment[c]}"
                )
    last = None
    for u in problem.random_units:  # Note [random order]
        if last is not None and assignment[u] < assignment[last]:
            out.append(
                f"{problem.names[u]!r} draws random numbers on stage {assignment[u]}, before "
                f"{problem.names[last]!r} on stage {assignment[last]} that draws them earlier in the program"
            )
        last = u if last is None or assignment[u] >= assignment[last] else last
    empty = sorted(set(range(S)) - set(assignment))
    if empty:
        out.append(f"stages {empty} hold no unit")
    if problem.memory_limit is not None:
        ev = evaluation or evaluate(problem, assignment)
        what = "stage" if problem.virtual_stages == 1 else "rank"
        for r, need in enumerate(ev.rank_memory_bytes):
            if need > problem.memory_limit:
                out.append(f"{what} {r} needs {need} bytes > limit {problem.memory_limit}")
    return out
