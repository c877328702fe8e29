"""The partitioning problem as plain arrays, and the exact cost of one assignment.

Note [stage cost]: every solver, baseline and report is judged by ``evaluate`` below.

* A *tensor* is one output of one unit, ``(producer, output index)``. It is sent once
  from the producer's stage to every *other* stage that holds a consumer (a skip
  connection into stages b and c is two messages, one straight to each); stages in
  between do not touch it. Each message costs ``bytes / link_bandwidth +
  link_latency`` on the sender AND on the receiver. In backward the gradient goes the
  other way, for tensors whose ``TensorSpec.requires_grad``. Model inputs travel on no
  edge (Note [model inputs] in ``fxpipe.tracer.profile``).
* Stage time = (fwd + bwd compute of its units) / device speed + its message times.
* Stage memory = distinct parameters used by its units (a tied parameter on every
  stage that uses it) x (1 + 1 for gradients + optimizer factor) + buffers
  + activation bytes x microbatches in flight + boundary buffers: received inputs x
  microbatches in flight k (kept for backward), plus sent outputs x M and the input
  gradients sent back (received tensors that require grad) x (M - k + 1), because the
  runtime keeps every posted send alive until the step ends (``runtime.stage_io``;
  measured with ``runtime.memory.TensorMemoryTracker``). Gradients: at the peak, while
  k inputs are still held, both schedules have posted the gradients of M - k
  microbatches and are making one more (1F1B last stage: all M; GPipe: 1). In flight
  on stage i of S: GPipe all M, 1F1B ``min(M, S - i)``; M is
  ``PartitionProblem.microbatches``.
* Data parallelism (``cost.dp_replicas`` > 1): each stage's distinct parameters are
  all-reduced once per step (``PartitionProblem.dp_allreduce_ms``: the cost model's
  ``allreduce_ms`` with the parameters' shapes, Note [hook pricing]), or gathered and
  reduce-scattered as ``cost.shard`` says (Note [sharding pricing], which also divides
  the parameter, gradient and optimizer bytes per rank), reported as
  ``StageCost.dp_allreduce_ms`` and ``dp_bytes``. It is not part of the per-microbatch ``stage_ms`` the
  solvers balance (it is paid once per step, not per microbatch); the predicted step
  time adds the largest one (``planner.predict``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fxpipe.errors import PartitionError, PinError
from fxpipe.partitioner.cost import CostModel
from fxpipe.partitioner.schedule import SCHEDULE_NAMES
from fxpipe.tracer.profile import ModelProfile

__all__ = ["Tensor", "PartitionProblem", "StageCost", "Evaluation", "build_problem", "evaluate",
           "assignment_violations", "in_flight"]



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
    param_bytes: tuple[int, ...]              # size of each distinct parameter
    param_names: tuple[str, ...]
    tensors: tuple[Tensor, ...]
    pins: tuple[int | None, ...]
    num_stages: int
    schedule: str = "1f1b"
    microbatches: int = 1
    cost: CostModel = CostModel()
    memory_limit: int | None = None
    param_shapes: tuple[tuple[int, ...] | None, ...] = ()  # per param_bytes entry; None: unknown

    @property
    def num_units(self) -> int:
        return len(self.names)

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
        return in_flight(self.schedule, self.microbatches, self.num_stages, stage)

    def grads_held(self, stage: int) -> int:
        """Input-gradient sends stage ``stage`` holds at its peak: ``M - in_flight + 1`` (Note [stage cost])."""
        return self.microbatches - self.in_flight(stage) + 1

    def dp_allreduce_ms(self, params: Iterable[int]) -> float:
        """Per-step data-parallel communication of these parameters (indices into ``param_bytes``):
        the gradient all-reduce, or the sharding level's collectives (Note [sharding pricing])."""
        mine = sorted(set(params))
        shapes = [self.param_shapes[p] if p < len(self.param_shapes) else None for p in mine]
        return self.cost.dp_comm_ms([self.param_bytes[p] for p in mine], shapes, self.microbatches)

    def dp_wire_bytes(self, params: Iterable[int]) -> float:
        """Bytes one rank sends per step on the data-parallel link for these parameters."""
        mine = sorted(set(params))
        shapes = [self.param_shapes[p] if p < len(self.param_shapes) else None for p in mine]
        traffic = self.cost.shard_traffic([self.param_bytes[p] for p in mine], shapes, self.microbatches)
        return traffic.wire_bytes(self.cost.dp_replicas)

    @property
    def state_factor(self) -> float:
        """Bytes of training state per rank per parameter byte: the weight, its gradient, optimizer
        state (2 + optimizer factor, divided over the replicas as ``cost.shard`` says)."""
        return self.cost.state_factor


def in_flight(schedule: str, microbatches: int, num_stages: int, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak under ``schedule``."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, num_stages - stage)


def build_problem(profile: ModelProfile, num_stages: int, *, schedule: str = "1f1b", microbatches: int = 1,
                  cost: CostModel | None = None, memory_limit: int | None = None) -> PartitionProblem:
    """Flatten ``profile`` for ``num_stages`` stages, checking the request is well posed."""
    cost = cost or CostModel()
    n = len(profile.units)
    if schedule not in SCHEDULE_NAMES:
        raise PartitionError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULE_NAMES)}")
    if microbatches < 1:
        raise PartitionError(f"microbatches must be >= 1, got {microbatches}")
    if num_stages < 1:
        raise PartitionError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n:
        raise PartitionError(
            f"cannot split {n} units into {num_stages} stages: every stage needs at least one unit; "
            f"use at most {n} stages or trace with finer units"
        )
    if memory_limit is not None and memory_limit <= 0:
        raise PartitionError(f"memory_limit must be a positive number of bytes, got {memory_limit}")
    cost.speeds(num_stages)
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
        unit_params=unit_params, param_bytes=param_bytes, param_names=param_names,
        tensors=_tensors(profile, index),
        pins=pins, num_stages=num_stages, schedule=schedule, microbatches=microbatches,
        cost=cost, memory_limit=memory_limit,
        param_shapes=tuple(profile.param_shapes.get(name) for name in param_names),
    )


def _params(profile: ModelProfile) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[str, ...]]:
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
    dp_bytes: float = 0.0         # bytes one rank sends per step on the data-parallel link

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
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes
                + self.activation_bytes + self.boundary_bytes)


@dataclass(frozen=True)
class Evaluation:
    """The exact cost of one assignment: every stage, the bottleneck and the peak memory."""

    stages: tuple[StageCost, ...]

    @property
    def bottleneck_ms(self) -> float:
        return max(s.stage_ms for s in self.stages)

    @property
    def peak_memory_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)


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
    for u, s in enumerate(assignment):
        fwd[s] += problem.fwd_ms[u]
        bwd[s] += problem.bwd_ms[u]
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
        ms = problem.cost.message_ms(t.nbytes)
        for d in {assignment[c] for c in t.consumers} - {a}:
            for s in (a, d):
                cf[s] += ms
                msgs[s] += 1
                if t.requires_grad:
                    cb[s] += ms
                    msgs[s] += 1
            sent[a] += t.nbytes
            recv[d] += t.nbytes
            if t.requires_grad:
                recv_grad[d] += t.nbytes
    stages = []
    for s in range(S):
        pb = sum(problem.param_bytes[p] for p in params[s])
        state = problem.cost.stage_state_bytes(pb)  # per rank: sharding divides it (Note [sharding pricing])
        k = problem.in_flight(s)
        stages.append(StageCost(
            fwd_ms=fwd[s] / speeds[s], bwd_ms=bwd[s] / speeds[s], comm_fwd_ms=cf[s], comm_bwd_ms=cb[s],
            send_bytes=sent[s], recv_bytes=recv[s], messages=msgs[s],
            param_bytes=state[0], grad_bytes=state[1], optimizer_bytes=state[2],
            buffer_bytes=buf[s], activation_bytes=act[s] * k,
            boundary_bytes=recv[s] * k + sent[s] * problem.microbatches + recv_grad[s] * problem.grads_held(s),
            in_flight=k,
            dp_allreduce_ms=problem.dp_allreduce_ms(params[s]), dp_bytes=problem.dp_wire_bytes(params[s]),
        ))
    return Evaluation(tuple(stages))


def assignment_violations(problem: PartitionProblem, assignment: Sequence[int],
                          evaluation: Evaluation | None = None) -> list[str]:
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
                out.append(f"{problem.names[t.producer]!r} (stage {assignment[t.producer]}) feeds "
                           f"{problem.names[c]!r} on earlier stage {assignment[c]}")
    empty = sorted(set(range(S)) - set(assignment))
    if empty:
        out.append(f"stages {empty} hold no unit")
    if problem.memory_limit is not None:
        ev = evaluation or evaluate(problem, assignment)
        for s, st in enumerate(ev.stages):
            if st.memory_bytes > problem.memory_limit:
                out.append(f"stage {s} needs {st.memory_bytes} bytes > limit {problem.memory_limit}")
    return out
