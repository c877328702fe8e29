"""``PlanOptions``: what ``fxpipe plan`` and ``fxpipe partition`` plan for, as one validated value.

The fields are the one declaration of these options (Note [options declared once] in
``fxpipe.optionspec``): the verbs' flags and their help come from them, and
``cost_model`` derives the ``CostModel`` the planner prices with, so no translation table
stands between the flags and the cost model. The data-parallel fields are ``CostModel``'s
own (``same_as``); ``fxpipe run``'s ``DataParallelOptions`` takes over the same ones.
Imports neither torch nor OR-Tools: the CLI builds its parsers from it at start-up.

>>> options = PlanOptions(stages=2, link="ethernet", dp=2, comm_hook="fp16")
>>> options.cost_model(trace_device="cpu").link_bandwidth, options.cost_model("cpu").comm_hook
(1250000000.0, 'fp16')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from fxpipe.errors import ConfigError
from fxpipe.optionspec import Options, option, same_as
from fxpipe.partitioner.cost import (
    LINK_PRESETS,
    OPTIMIZER_STATE_FACTOR,
    CostModel,
    default_link,
    parse_size,
)
from fxpipe.partitioner.schedule import AUTO, SCHEDULE_NAMES
from fxpipe.partitioner.seqlen import check_seq_len

__all__ = ["PlanOptions", "SOLVER_NAMES", "OPTIMIZE"]

# fxpipe.partitioner.solve.planner.SOLVERS, named here so that the parser imports no solver
SOLVER_NAMES = ("auto", "dp", "cpsat", "greedy", "params", "uniform")
OPTIMIZE = ("speed", "memory")


@dataclass(frozen=True, kw_only=True)
class PlanOptions(Options):
    """How to plan a profile: stages, microbatches, solver, schedule, memory, links, the
    optimizer and precision the memory and traffic models count, and data parallelism.

    ``stages`` ranks of ``virtual_stages`` stages each (``None``: a cluster search chooses,
    ``fxpipe.partitioner.search.args``); ``link`` a preset of ``LINK_PRESETS`` (``None``: the
    trace device's, ``default_link``) whose ``link_bandwidth`` (GB/s) and ``link_latency``
    (µs) may be overridden; ``speed_factors`` the relative speed of each stage's device,
    as typed (``"1,1,0.5"``); ``dp`` replicas whose gradient traffic is priced with
    ``comm_hook`` and ``shard``.
    """

    what: ClassVar[str] = "plan options"

    stages: int | None = option(
        None,
        metavar="N",
        none_means="none; give it, or --devices N",
        help="number of pipeline stages (or --devices N to search the stages, replicas "
        "and the rest)",
    )
    microbatches: int | None = option(
        None, metavar="M", none_means="the number of stages", help="microbatches per step"
    )
    solver: str = option("auto", choices=SOLVER_NAMES, help="partitioning solver: %(choices)s")
    # --schedule, --virtual-stages, --optimizer and --dp are declared here, once: fxpipe run's
    # RunOptions and TrainingOptions take them over (same_as) with the run's default and choices
    schedule: str = option(
        "1f1b",
        choices=(*SCHEDULE_NAMES, AUTO),
        metavar="NAME",
        help="pipeline schedule to plan for: %(choices)s (auto: plan each, keep the fastest "
        "that fits)",
    )
    virtual_stages: int | None = option(
        None,
        metavar="V",
        none_means="the schedule's least (1, or 2 for interleaved-1f1b and zbv)",
        help="stages per rank: --stages N gives N x V stages, placed loop-style "
        "(interleaved-1f1b) or V-shaped (zbv)",
    )
    memory_limit: str | None = option(
        None, metavar="SIZE", none_means="unbounded", help="memory per device, e.g. 512MiB or 16GiB"
    )
    time_limit: float = option(10.0, metavar="S", help="CP-SAT time limit in seconds")
    link: str | None = option(
        None,
        metavar="NAME",
        none_means="nvlink for a CUDA trace, loopback for a CPU one",
        help=f"link preset: {', '.join(LINK_PRESETS)}",
    )
    link_bandwidth: float | None = option(
        None,
        metavar="GB/S",
        none_means="the preset's",
        help="link bandwidth in GB/s (overrides the preset)",
    )
    link_latency: float | None = option(
        None,
        metavar="US",
        none_means="the preset's",
        help="per-message latency in microseconds (overrides the preset)",
    )
    optimizer: str = option(
        "sgd",
        choices=tuple(OPTIMIZER_STATE_FACTOR),
        metavar="NAME",
        help="optimizer whose state the memory model counts: %(choices)s",
    )
    precision: str = same_as(CostModel, "precision")
    speed_factors: str | None = option(
        None,
        metavar="S1,S2,...",
        none_means="all 1",
        help="comma-separated relative speed per stage device, e.g. 1,1,0.5",
    )
    optimize: str = option(
        "speed",
        choices=OPTIMIZE,
        help="what the plan minimises: %(choices)s (memory: the least peak memory within 1%% of "
        "the fastest step)",
    )
    split_at: tuple[str, ...] = option(
        (),
        repeat=True,
        metavar="MODULE",
        help="start a stage at this module path (like pipelining's "
        "SplitPoint.BEGINNING); repeatable, stages - 1 times",
    )
    dp: int = option(
        1,
        metavar="R",
        help="price each stage's gradient all-reduce over R pipeline replicas (1: none)",
    )
    # a wrong value is the cost model's one error line, not argparse's usage message
    comm_hook: str = same_as(CostModel, "comm_hook")
    powersgd_rank: int = same_as(CostModel, "powersgd_rank")
    shard: str = same_as(CostModel, "shard", parse_choices=False)
    shard_reduce: str = same_as(CostModel, "shard_reduce", parse_choices=False)
    shard_param_dtype: str | None = same_as(CostModel, "shard_param_dtype", parse_choices=False)

    # Note [pricing at a length] in fxpipe.partitioner.seqlen
    seq_len: str | None = option(
        None,
        metavar="L",
        none_means="the traced length",
        help="price the plan at sequence length L (every dynamic dimension of the profile; or "
        "seq=512,tgt=128), or at the expected step over weighted lengths, e.g. 128:3,512:1",
        check=check_seq_len,
    )
    seq_len_histogram: str | None = option(
        None,
        metavar="FILE",
        none_means="none",
        help="price the plan at the expected step over the lengths in FILE (one LENGTH WEIGHT per "
        "line, or a JSON object); memory at the longest",
    )

    def __post_init__(self) -> None:
        if self.seq_len is not None and self.seq_len_histogram is not None:
            raise ConfigError("give --seq-len or --seq-len-histogram, not both")
        for flag, value in (
            ("--link-bandwidth", self.link_bandwidth),
            ("--link-latency", self.link_latency),
            ("--time-limit", self.time_limit),
        ):
            if value is not None and not math.isfinite(value):  # nan/inf would end up in plan.json
                raise ConfigError(f"{flag} must be a finite number, got {value}")
        _ = (
            self.device_speed,
            self.memory_limit_bytes,
        )  # each refuses a value it cannot read, naming its flag

    @property
    def device_speed(self) -> tuple[float, ...]:
        """``speed_factors`` as numbers (empty: every device alike)."""
        if not self.speed_factors:
            return ()
        try:
            speeds = tuple(float(s) for s in self.speed_factors.split(","))
        except ValueError:
            raise ConfigError(
                f"--speed-factors {self.speed_factors!r} must be numbers separated by commas"
            ) from None
        if not all(math.isfinite(s) and s > 0 for s in speeds):
            raise ConfigError(
                f"--speed-factors {self.speed_factors!r} must be finite numbers > 0, e.g. 1,1,0.5"
            )
        return speeds

    @property
    def memory_limit_bytes(self) -> int | None:
        """``memory_limit`` in bytes (``None``: unbounded)."""
        try:
            return parse_size(self.memory_limit) if self.memory_limit else None
        except ConfigError as exc:
            raise ConfigError(f"--memory-limit: {exc}") from None

    def priced(self, profile: Any) -> Any:
        """The ``ModelProfile`` the planner prices: ``profile`` at ``--seq-len`` or over
        ``--seq-len-histogram`` (neither: as traced; Note [pricing at a length])."""
        from fxpipe.partitioner.seqlen import price_for_options

        return price_for_options(profile, self.seq_len, self.seq_len_histogram)

    def search_cost_fields(self) -> dict[str, Any]:
        """The cost-model fields of these options that the cluster search (``--devices``) takes
        as the job's own, where they differ from the default (Note [what the job prices] in
        ``fxpipe.partitioner.search.configurations``): the search chooses the sharding level,
        replicas and links itself."""
        defaults = {f.name: f.default for f in fields(CostModel)}
        return {
            name: getattr(self, name)
            for name in _PRICED
            if name not in ("optimizer", "shard") and getattr(self, name) != defaults[name]
        }

    def cost_model(self, trace_device: str) -> CostModel:
        """The cost model these options price with, for a profile traced on ``trace_device``
        (whose kind of device names the link when ``link`` does not)."""
        if self.dp == 1 and (
            self.shard != "none" or self.shard_reduce != "step" or self.shard_param_dtype
        ):
            raise ConfigError(
                "--shard, --shard-reduce and --shard-param-dtype divide state over data-parallel "
                "replicas, but --dp is 1; add --dp R (R >= 2) or drop them"
            )
        overrides: dict[str, Any] = {name: getattr(self, name) for name in _PRICED}
        overrides.update(dp_replicas=self.dp, device_speed=self.device_speed)
        if self.link_bandwidth is not None:
            overrides["link_bandwidth"] = self.link_bandwidth * 1e9
        if self.link_latency is not None:
            overrides["link_latency"] = self.link_latency * 1e-6
        return CostModel.preset(self.link or default_link(trace_device), **overrides)


# the fields the cost model takes as they are (optimizer, precision, comm_hook, shard, ...); not the link, whose
# preset gives the bandwidth and latency that the flags override in GB/s and microseconds
_PRICED = tuple(
    f.name
    for f in fields(PlanOptions)
    if f.name in {g.name for g in fields(CostModel)}
    and f.name not in ("link", "link_bandwidth", "link_latency")
)
