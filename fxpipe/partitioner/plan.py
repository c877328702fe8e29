"""``PartitionPlan``: which stage runs each unit, and what that is predicted to cost.

It is the contract between the partitioner and codegen (``stages[i].units``,
``stage_of``) and carries every prediction (stage times, memory, step time, bubble,
throughput) so the runtime and benchmarks can check them against measurements.
Times are milliseconds per microbatch unless named ``step``; sizes are bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fxpipe.errors import PartitionError
from fxpipe.jsonio import check_schema_version, dump_json, load_json

__all__ = ["StagePlan", "PartitionPlan", "PLAN_SCHEMA_VERSION"]

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StagePlan:
    """One stage: its units (topological order) and its predicted time and memory.

    ``fwd_ms``/``bwd_ms`` are compute only (already divided by the device speed);
    ``comm_ms`` = ``comm_fwd_ms + comm_bwd_ms`` is the time of its messages;
    ``stage_ms`` = ``compute_ms + comm_ms``. ``memory`` breaks ``memory_bytes`` down into
    params, grads, optimizer, buffers, activations and boundary (Note [stage cost] in
    ``fxpipe.partitioner.problem``). ``dp_allreduce_ms`` is the once-per-step all-reduce
    of its gradients across data-parallel replicas (0 with one replica).
    """

    index: int
    units: tuple[str, ...]
    fwd_ms: float
    bwd_ms: float
    compute_ms: float
    comm_fwd_ms: float
    comm_bwd_ms: float
    comm_ms: float
    stage_ms: float
    send_bytes: int
    recv_bytes: int
    messages: int
    memory: dict[str, int]
    memory_bytes: int
    in_flight: int
    speed: float = 1.0
    dp_allreduce_ms: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        if not self.units:
            raise PartitionError(f"stage {self.index} of a plan has no units")


@dataclass(frozen=True)
class PartitionPlan:
    """A stage assignment with its predicted costs, bound, solver facts and baselines.

    >>> plan.stage_of("blocks.3.mlp")   # doctest: +SKIP
    1
    """

    stages: tuple[StagePlan, ...]
    bottleneck_ms: float
    lower_bound_ms: float
    gap: float
    optimal: bool
    solver: str
    solver_bound_ms: float | None
    solve_seconds: float
    schedule: str
    microbatches: int
    num_stages: int
    microbatch_size: int = 1
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    prediction: dict[str, Any] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)
    memory_limit: int | None = None
    optimize: str = "speed"
    lower_bounds: dict[str, float] = field(default_factory=dict)
    status: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(
            s if isinstance(s, StagePlan) else StagePlan(**s) for s in self.stages))
        if len(self.stages) != self.num_stages:
            raise PartitionError(f"plan lists {len(self.stages)} stages but num_stages is {self.num_stages}")
        seen: set[str] = set()
        for s in self.stages:
            dup = seen.intersection(s.units)
            if dup:
                raise PartitionError(f"units {sorted(dup)} are on more than one stage")
            seen.update(s.units)

    @cached_property
    def _stage_index(self) -> dict[str, int]:
        return {u: s.index for s in self.stages for u in s.units}

    def stage_of(self, unit_name: str) -> int:
        """The stage that runs ``unit_name``."""
        try:
            return self._stage_index[unit_name]
        except KeyError:
            raise PartitionError(f"unit {unit_name!r} is not in this plan; was it made from another profile?") from None

    @property
    def assignment(self) -> dict[str, int]:
        """Stage of every unit, by name."""
        return dict(self._stage_index)

    @property
    def step_ms(self) -> float:
        """Predicted time of one training step under the plan's schedule."""
        return float(self.prediction["step_ms"][self.schedule])

    # -- JSON ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for s in d["stages"]:
            s["units"] = list(s["units"])
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartitionPlan:
        check_schema_version(d, PLAN_SCHEMA_VERSION, "plan", PartitionError)
        missing = [k for k in ("stages", "bottleneck_ms", "num_stages") if k not in d]
        if missing:
            raise PartitionError(f"plan is missing the fields {missing}; regenerate it with `fxpipe plan`")
        known = set(cls.__dataclass_fields__)
        stage_known = set(StagePlan.__dataclass_fields__)
        data = {k: v for k, v in d.items() if k in known}
        data["stages"] = tuple(StagePlan(**{k: v for k, v in s.items() if k in stage_known}) for s in d["stages"])
        return cls(**data)

    @classmethod
    def from_json(cls, source: str | Path) -> PartitionPlan:
        """Load from a path or a JSON string."""
        return cls.from_dict(load_json(source, "plan", PartitionError))
