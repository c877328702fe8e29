"""``PartitionPlan``: which stage runs each unit, and what that is predicted to cost.

It is the contract between the partitioner and codegen (``stages[i].units``,
``stage_of``, ``stages[i].rank``) and carries every prediction (stage times, memory,
step time, bubble, throughput) so the runtime and benchmarks can check them against
measurements. Times are milliseconds per microbatch unless named ``step``; sizes are
bytes. With ``virtual_stages`` V > 1 the stages are the build's chunks, V per rank.

Note [analytic CPU estimate]: a profile traced on the CPU without ``--measure-times`` prices
each unit by a roofline and per-op costs calibrated on one quiet host with a core per rank
(``fxpipe/calibration.json``). Its ratios hold: splits and schedules of the same units under
the same constants rank as they run. Its milliseconds do not: on another CPU, or the same one
shared with other work, a step takes the host's speed and load times as long, which nothing
known when planning foresees (the README's examples ran 5-11x their estimate on the shared
development VM under load). So such a plan (``unit_times == "cpu analytic"``,
``PartitionPlan.predicts_time`` False) prints no step time, throughput or run comparison in
milliseconds: reports show each step relative to the plan's own, and say why; ``fxpipe run``
records no predicted step. ``--measure-times`` times the units on this machine and gauges its
speed: those plans predict times.

What is optimal: the plan's objective (``objective == "step"``) is the predicted step
time of its schedule, the best of several candidate splits (Note [planning for step
time] in ``fxpipe.partitioner.solve.refine``), not a proven optimum; ``optimal`` and ``gap``
speak of the bottleneck stage time, which the exact solvers prove.

Reading a plan checks every field against its type hint (``fxpipe.schema``). Schema
version 1 (the same fields, with a prediction that did not name its schedule) is read
as it is; the documented minimal plan (stages with their ``units``, ``bottleneck_ms``,
``lower_bound_ms``, ``optimal``, ``solver``, ``baselines``) is completed with defaults.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fxpipe.errors import PartitionError
from fxpipe.jsonio import check_schema_version, dump_json, load_json
from fxpipe.partitioner.cost import CostModel
from fxpipe.partitioner.prediction import Prediction
from fxpipe.partitioner.schedule import ActionKind, Timeline, make_schedule, simulate_step
from fxpipe.tracer.profile import PricedAt
from fxpipe.schema import NonNegFloat, NonNegInt, PositiveInt, read_dataclass

__all__ = [
    "StageMemory",
    "StagePlan",
    "BaselineReport",
    "ScheduleOption",
    "PartitionPlan",
    "PLAN_SCHEMA_VERSION",
    "stage_timeline",
    "ANALYTIC_CPU",
]

ANALYTIC_CPU = "cpu analytic"  # ``PartitionPlan.unit_times`` of a plan whose steps are not times (Note [analytic CPU estimate])

PLAN_SCHEMA_VERSION = 2  # 2: typed prediction (names its schedule; derived figures are properties)
_OLDEST_READABLE = 1
_REMEDY = "re-plan with `fxpipe plan` or `fxpipe partition`"


@dataclass(frozen=True)
class StageMemory:
    """A stage's peak memory by kind, in bytes (Note [stage cost] in ``fxpipe.partitioner.problem``)."""

    params: NonNegInt = 0
    grads: NonNegInt = 0
    optimizer: NonNegInt = 0
    buffers: NonNegInt = 0
    activations: NonNegInt = 0
    boundary: NonNegInt = 0


@dataclass(frozen=True)
class StagePlan:
    """One stage: its units (topological order) and its predicted time and memory.

    ``fwd_ms``/``bwd_ms`` are compute only (already divided by the device speed);
    ``comm_ms`` = ``comm_fwd_ms + comm_bwd_ms`` is the time of its messages;
    ``stage_ms`` = ``compute_ms + comm_ms``. ``memory`` breaks ``memory_bytes`` down into
    params, grads, optimizer, buffers, activations and boundary (per rank: sharding divides
    the first three). ``dp_allreduce_ms`` is the once-per-step data-parallel communication
    (the gradient all-reduce, or the sharding level's all-gathers and reduce-scatters) and
    ``dp_bytes`` what one rank sends for it (0 with one replica).
    """

    index: NonNegInt
    units: tuple[str, ...]
    fwd_ms: NonNegFloat = 0.0
    bwd_ms: NonNegFloat = 0.0
    compute_ms: NonNegFloat = 0.0
    comm_fwd_ms: NonNegFloat = 0.0
    comm_bwd_ms: NonNegFloat = 0.0
    comm_ms: NonNegFloat = 0.0
    stage_ms: NonNegFloat = 0.0
    send_bytes: NonNegInt = 0
    recv_bytes: NonNegInt = 0
    messages: NonNegInt = 0
    memory: StageMemory = field(default_factory=StageMemory)
    memory_bytes: NonNegInt = 0
    in_flight: NonNegInt = 1
    speed: NonNegFloat = 1.0
    dp_allreduce_ms: NonNegFloat = 0.0
    bwd_weight_ms: NonNegFloat = 0.0  # of bwd_ms, the weight gradients (a zero-bubble schedule's W)
    rank: NonNegInt | None = None  # the pipeline rank that runs it; None: its index
    dp_bytes: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        if not self.units:
            raise PartitionError(f"stage {self.index} of a plan has no units")


@dataclass(frozen=True)
class BaselineReport:
    """A baseline strategy's split priced by the same cost model as the plan.

    Only ``bottleneck_ms`` is required (the documented minimal plan); fxpipe writes all.
    ``violations`` are the first constraints it breaks (memory limit, pins), if any.
    """

    bottleneck_ms: NonNegFloat
    ratio_to_plan: NonNegFloat | None = None
    stage_ms: tuple[NonNegFloat, ...] = ()
    memory_bytes: tuple[NonNegInt, ...] = ()
    units_per_stage: tuple[NonNegInt, ...] = ()
    step_ms: NonNegFloat | None = None
    feasible: bool = True
    violations: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScheduleOption:
    """One schedule that ``--schedule auto`` planned: its own split's predicted step, bubble and
    peak rank memory, and whether it fits (``note`` says why not, or what limits it)."""

    schedule: str
    virtual_stages: PositiveInt = 1
    step_ms: NonNegFloat | None = None
    bubble: NonNegFloat | None = None
    peak_memory_bytes: NonNegInt | None = None
    feasible: bool = True
    chosen: bool = False
    note: str = ""
    stage_times: tuple[
        tuple[NonNegFloat, NonNegFloat, NonNegFloat], ...
    ] = ()  # per stage: F, B, W-part ms

    def timeline(self, microbatches: int) -> Timeline | None:
        """Its split's step timeline (communication in the stage times), for the report."""
        if not self.stage_times:
            return None
        return stage_timeline(self.schedule, self.virtual_stages, microbatches, self.stage_times)


@dataclass(frozen=True)
class PartitionPlan:
    """A stage assignment with its predicted costs, bound, solver facts and baselines.

    ``cost`` is the cost model the plan was priced with; ``prediction`` the predicted step
    (``None`` only in a hand-written plan).

    >>> plan.stage_of("blocks.3.mlp")   # doctest: +SKIP
    1
    """

    stages: tuple[StagePlan, ...]
    bottleneck_ms: NonNegFloat
    lower_bound_ms: NonNegFloat
    gap: NonNegFloat
    optimal: bool
    solver: str
    solver_bound_ms: NonNegFloat | None
    solve_seconds: NonNegFloat
    schedule: str
    microbatches: PositiveInt
    num_stages: PositiveInt
    microbatch_size: PositiveInt = 1
    baselines: dict[str, BaselineReport] = field(default_factory=dict)
    prediction: Prediction | None = None
    cost: CostModel = field(default_factory=CostModel)
    memory_limit: PositiveInt | None = None
    optimize: str = "speed"
    lower_bounds: dict[str, NonNegFloat] = field(default_factory=dict)
    status: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION
    virtual_stages: PositiveInt = 1
    placement: str = "loop"
    objective: str = (
        "bottleneck"  # "step": the predicted step time of the schedule; older plans: the bottleneck
    )
    rank_memory_bytes: tuple[NonNegInt, ...] = ()
    alternatives: tuple[ScheduleOption, ...] = ()  # --schedule auto: every schedule it planned
    unit_times: str = ""  # the profile's unit times: "<trace device> <timing>", e.g. "cpu analytic"; "": not recorded
    compiled: bool = (
        False  # planned from units priced compiled (profile.compiled); older plans: eager
    )
    compile_factor: float | None = None  # the profile's compiled-kernel factor (analytic times)
    # the lengths the plan was priced at (Note [pricing at a length]); (): no dynamic dimension
    priced_at: tuple[PricedAt, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if len(self.stages) != self.num_stages:
            raise PartitionError(
                f"plan lists {len(self.stages)} stages but num_stages is {self.num_stages}"
            )
        seen: set[str] = set()
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise PartitionError(f"plan stage {i} says it is stage {s.index}")
            dup = seen.intersection(s.units)
            if dup:
                raise PartitionError(f"units {sorted(dup)} are on more than one stage")
            seen.update(s.units)
        if self.prediction is not None and self.prediction.schedule != self.schedule:
            raise PartitionError(
                f"the plan's schedule is {self.schedule!r} but its prediction is for "
                f"{self.prediction.schedule!r}"
            )
        if self.num_stages % self.virtual_stages:
            raise PartitionError(
                f"the plan has {self.num_stages} stages, not a multiple of its "
                f"{self.virtual_stages} virtual stages per rank"
            )

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks (processes per replica): the stages over ``virtual_stages``."""
        return self.num_stages // self.virtual_stages

    @property
    def stage_times(self) -> tuple[tuple[float, float, float], ...]:
        """Per stage: forward, backward (each with its messages) and the weight-gradient part, ms."""
        return tuple(
            (s.fwd_ms + s.comm_fwd_ms, s.bwd_ms + s.comm_bwd_ms, s.bwd_weight_ms)
            for s in self.stages
        )

    def timeline(self, schedule: str | None = None) -> Timeline:
        """The simulated step of this split under ``schedule`` (default the plan's), from the stage
        times alone (no runtime overheads): what the report draws."""
        return stage_timeline(
            schedule or self.schedule, self.virtual_stages, self.microbatches, self.stage_times
        )

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The pipeline rank of every stage."""
        return tuple(s.index if s.rank is None else s.rank for s in self.stages)

    @property
    def predicts_time(self) -> bool:
        """Whether the predicted step is a time the plan stands behind (Note [analytic CPU estimate]):
        not for unit times estimated analytically for a CPU, which rank splits and schedules only."""
        return self.prediction is not None and self.unit_times != ANALYTIC_CPU

    def relative_step(self, schedule: str) -> float | None:
        """``schedule``'s predicted step over the plan's own (1.0 for the plan's schedule)."""
        if (
            self.prediction is None
            or schedule not in self.prediction.step_ms
            or not self.step_ms > 0
        ):
            return None
        return float(self.prediction.step_ms[schedule]) / self.step_ms

    @property
    def optimal_for(self) -> str:
        """What the plan is optimal for, in words (reports print it)."""
        proven = (
            "the bottleneck stage time is proven minimal"
            if self.optimal
            else (
                f"its bottleneck stage time, {self.bottleneck_ms:.4g} ms, is within {self.gap:.1%} of "
                f"{self.lower_bound_ms:.4g} ms, a lower bound no split of these units can beat"
            )
        )
        if self.objective != "step":
            return f"planned for the bottleneck stage time: {proven}"
        return (
            f"planned for the predicted step time of {self.schedule} (chosen among candidate splits by the "
            f"predicted step, not a proven optimum); {proven}"
        )

    @cached_property
    def _stage_index(self) -> dict[str, int]:
        return {u: s.index for s in self.stages for u in s.units}

    def stage_of(self, unit_name: str) -> int:
        """The stage that runs ``unit_name``."""
        try:
            return self._stage_index[unit_name]
        except KeyError:
            raise PartitionError(
                f"unit {unit_name!r} is not in this plan; was it made from another profile?"
            ) from None

    @property
    def assignment(self) -> dict[str, int]:
        """Stage of every unit, by name."""
        return dict(self._stage_index)

    @property
    def step_ms(self) -> float:
        """Predicted time of one training step under the plan's schedule."""
        if self.prediction is None:
            raise PartitionError("this plan carries no prediction; re-plan it with `fxpipe plan`")
        return float(self.prediction.step_ms[self.schedule])

    def predicted_step_ms(
        self,
        schedule: str,
        *,
        microbatches: int,
        dp_replicas: int = 1,
        comm_hook: str = "allreduce",
        powersgd_rank: int = 1,
        shard: str = "none",
    ) -> float | None:
        """The predicted step time under ``schedule`` if this plan was priced for a run like
        this one (``microbatches``; ``dp_replicas`` replicas whose all-reduce uses
        ``comm_hook`` with PowerSGD rank ``powersgd_rank``, sharded as ``shard``), else ``None``: a prediction
        for another configuration says nothing about this run.

        >>> plan.predicted_step_ms("1f1b", microbatches=4, dp_replicas=2, comm_hook="fp16")  # doctest: +SKIP
        """
        if self.prediction is None or self.microbatches != microbatches:
            return None
        cost = self.cost
        if cost.dp_replicas != dp_replicas or (dp_replicas > 1 and cost.comm_hook != comm_hook):
            return None
        if dp_replicas > 1 and "powersgd" in comm_hook and cost.powersgd_rank != powersgd_rank:
            return None
        if dp_replicas > 1 and cost.shard != shard:
            return None
        value = self.prediction.step_ms.get(schedule)
        return float(value) if value is not None else None

    # -- JSON ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path, what="plan", error=PartitionError)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartitionPlan:
        """A plan from JSON data, every field checked (one ``PartitionError`` naming the field).

        Reads schema versions 1 and 2 and the documented minimal plan.
        """
        check_schema_version(
            d, PLAN_SCHEMA_VERSION, "plan", PartitionError, oldest=_OLDEST_READABLE, remedy=_REMEDY
        )
        return read_dataclass(cls, _completed(d), "plan", PartitionError)

    @classmethod
    def from_json(cls, source: str | Path) -> PartitionPlan:
        """Load from a path or a JSON string."""
        return cls.from_dict(load_json(source, "plan", PartitionError))


def stage_timeline(
    schedule: str,
    virtual_stages: int,
    microbatches: int,
    stage_times: tuple[tuple[float, float, float], ...],
) -> Timeline:
    """The step simulator (Note [step simulation]) on per-stage F, B and W-part times: a split
    backward runs ``B - W`` in ``B`` and ``W`` in ``W``."""
    ranks = len(stage_times) // virtual_stages
    plan = make_schedule(schedule, ranks, microbatches, virtual_stages)
    split = plan.split_backward()

    def duration(a: Any) -> float:
        fwd, bwd, w = stage_times[a.stage]
        if a.kind is ActionKind.FORWARD:
            return fwd
        if a.kind is ActionKind.WEIGHT:
            return w
        return bwd - w if (a.stage, a.microbatch) in split else bwd

    return simulate_step(plan, duration)


def _completed(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with what a version-1 or minimal plan leaves out filled in: each stage's index,
    the stage count, gap, solver bound and time, schedule and microbatches, the prediction's
    schedule. Values of the wrong type are left for the schema check to name."""
    data = dict(d, schema_version=PLAN_SCHEMA_VERSION)
    stages = data.get("stages")
    if isinstance(stages, list):
        data["stages"] = [
            dict(s, index=s.get("index", i)) if isinstance(s, dict) else s
            for i, s in enumerate(stages)
        ]
        data.setdefault("num_stages", len(stages))
    bottleneck, bound = data.get("bottleneck_ms"), data.get("lower_bound_ms")
    if (
        "gap" not in data
        and isinstance(bottleneck, (int, float))
        and isinstance(bound, (int, float))
    ):
        data["gap"] = max(bottleneck - bound, 0.0) / bound if bound > 0 else 0.0
    data.setdefault("solver_bound_ms", None)
    data.setdefault("solve_seconds", 0.0)
    data.setdefault("schedule", "1f1b")
    data.setdefault("microbatches", 1)
    prediction = data.get("prediction")
    if isinstance(prediction, dict):
        data["prediction"] = (
            dict(prediction, schedule=prediction.get("schedule", data["schedule"]))
            if prediction
            else None
        )
    return data
