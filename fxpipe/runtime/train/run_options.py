"""``RunOptions``: everything a training run of a build directory is told, as one validated value.

``fxpipe run`` builds it from its flags, validates it before torchrun starts and writes it
as JSON for the workers (``--options PATH``); ``python -m fxpipe.runtime.launch.worker DIR``
reads the same flags, or that file, or both (flags win). ``add_run_arguments`` and
``run_options_from_args`` are the one command-line form of the options, so the two entry
points cannot drift apart, and the defaults live only in the dataclass.

Note [None is resolved where it is known]: ``schedule``, ``virtual_stages``,
``microbatches`` and ``batch_size`` left ``None`` are the build's; ``dp`` is the plan's replicas for
``fxpipe run`` (1 without a plan; ``with_plan_defaults``, which also takes the plan's sharding when
``--shard`` is left out) and ``WORLD_SIZE / stages`` under a torchrun that someone else started; ``device`` is ``cuda:LOCAL_RANK`` when CUDA
is available, else ``cpu``.

A new option is a field here or in a nested group (``DataParallelOptions``,
``TrainingOptions``), declared with ``option(...)`` (its flag, help, metavar, choices), and
its check in ``__post_init__``: the flags, their help and the JSON come from the field
(Note [options declared once] in ``fxpipe.optionspec``). Building a parser with these
flags imports neither torch nor OR-Tools: the CLI builds every verb's parser at start-up.

>>> options = RunOptions(steps=4, schedule="gpipe", dp=2, data_parallel=DataParallelOptions(comm_hook="fp16"))
>>> RunOptions.from_json(options.to_json()) == options
True
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from fxpipe.errors import ConfigError
from fxpipe.jsonio import load_json
from fxpipe.optionspec import (
    Options,
    add_arguments,
    group,
    groups_of,
    namespace_values,
    option,
    same_as,
)
from fxpipe.partitioner.cost import CostModel
from fxpipe.partitioner.plan_options import PlanOptions
from fxpipe.partitioner.schedule import SCHEDULE_NAMES
from fxpipe.runtime.dataparallel.options import DataParallelOptions
from fxpipe.runtime.train.training_options import PRECISIONS, TrainingOptions
from fxpipe.tracer.trace_options import ModelTraceOptions

if TYPE_CHECKING:
    from fxpipe.partitioner.plan import PartitionPlan

__all__ = [
    "RunOptions",
    "RUN_OPTIONS_SCHEMA_VERSION",
    "DEFAULT_SCHEDULE",
    "DEFAULT_TIMEOUT_S",
    "add_run_arguments",
    "run_options_from_args",
    "explicit_fields",
    "with_plan_defaults",
]

RUN_OPTIONS_SCHEMA_VERSION = 1
DEFAULT_SCHEDULE = "1f1b"  # what a build that names no schedule runs (one stage per rank)
DEFAULT_TIMEOUT_S = 300.0
COMPILE_SCOPES = ("stage", "regional")  # fxpipe.runtime.pipeline.compiled, Note [compile scope]
DEFAULT_COMPILE_SCOPE = "stage"  # measured: docs/compile.md
# Note [compiled split backward] in fxpipe.runtime.pipeline.compiled: a region's backward under a
# schedule that splits it, as one compiled graph or cut into an input and a weight half
COMPILE_BACKWARDS = ("graph", "halves")
DEFAULT_COMPILE_BACKWARD = "halves"  # measured 0.93-0.98x the one-graph step: docs/compile.md
MAX_TIMEOUT_S = 1e8  # far below what a process group's timeout (int64 nanoseconds, a C int elsewhere) overflows at

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class RunOptions(Options):
    """How to train a build directory: steps, schedule, batch, learning rate, timeout, device, data
    parallelism, and the optimizer, data, eval, checkpoints and logs (``training``).

    ``steps`` optimizer steps with learning rate ``lr`` under ``schedule`` (one that runs on the
    build's ``virtual_stages`` stages per rank; both default to the build's), the batch of ONE
    pipeline replica (``batch_size``) cut into ``microbatches``; ``dp`` replicas of the
    pipeline kept in sync as ``data_parallel`` says; each stage's forward under autocast
    with ``precision="bf16"``; a peer silent for ``timeout_s`` seconds is an error.
    ``None`` fields are resolved later (see the module's Note).
    """

    what: ClassVar[str] = "run options"
    json_schema_version: ClassVar[int | None] = RUN_OPTIONS_SCHEMA_VERSION

    steps: int = option(10, metavar="K", help="training steps")
    # --schedule, --virtual-stages and --dp are PlanOptions' (declared once): a run takes the
    # build's by default and runs the schedules only (no auto)
    schedule: str | None = same_as(
        PlanOptions,
        "schedule",
        default=None,
        choices=SCHEDULE_NAMES,
        none_means="the build's",
        help="pipeline schedule: %(choices)s",
    )
    virtual_stages: int | None = same_as(
        PlanOptions,
        "virtual_stages",
        none_means="the build's",
        help="stages per rank; must be the build's (partition with --virtual-stages "
        "V to change it)",
    )
    microbatches: int | None = same_as(PlanOptions, "microbatches", none_means="the build's")
    batch_size: int | None = option(
        None, metavar="B", none_means="the build's", help="batch of one pipeline replica per step"
    )
    lr: float = option(
        0.01, metavar="LR", help="learning rate (the peak, with --warmup-steps / --lr-schedule)"
    )
    precision: str = same_as(CostModel, "precision")
    compile: bool = same_as(  # trace and partition price the stages as this runs them
        ModelTraceOptions,
        "compile",
        help="run every stage under torch.compile, compiled before the first step "
        "(fxpipe.runtime.pipeline.compiled)",
    )
    compile_scope: str = option(
        DEFAULT_COMPILE_SCOPE,
        choices=COMPILE_SCOPES,
        metavar="SCOPE",
        help="with --compile: each stage whole, or each repeated block: %(choices)s",
    )
    compile_backward: str = option(
        DEFAULT_COMPILE_BACKWARD,
        choices=COMPILE_BACKWARDS,
        metavar="FORM",
        help="with --compile under zb-h1, zbv or dualpipev: each compiled backward as one graph "
        "(B computes every gradient, W hands the weight gradients over) or cut in an input half "
        "run in B and a weight half run in W: %(choices)s",
    )
    compile_cache: str | None = option(
        None,
        metavar="DIR",
        none_means="BUILD/compile_cache, or TORCHINDUCTOR_CACHE_DIR when set",
        help="with --compile: inductor's cache folder (a second run loads what the first compiled)",
    )
    compile_unchecked: bool = option(
        False,
        help="with --compile: skip the warm-up's check of each compiled stage against its eager "
        "code (a stage that differs otherwise stops the run before the first step)",
    )
    timeout_s: float = option(
        DEFAULT_TIMEOUT_S,
        flag="--timeout",
        metavar="S",
        help="seconds before a silent peer is an error",
    )
    device: str | None = option(
        None,
        metavar="DEVICE",
        none_means="cuda:LOCAL_RANK when CUDA is available, else cpu",
        help="cpu, cuda or cuda:N",
    )
    dp: int | None = same_as(
        PlanOptions,
        "dp",
        default=None,
        help="data-parallel replicas of the pipeline: stages x R processes",
        none_means="the plan's replicas with `fxpipe run`, WORLD_SIZE / stages under your own "
        "torchrun",
    )
    tp: int = option(
        1,
        metavar="T",
        help="tensor-parallel ranks per stage, tp innermost: stages x dp x T processes "
        "(docs/tensor-parallel.md)",
    )
    tp_plan: str | None = option(
        None,
        metavar="FILE",
        none_means="the build's tp_plan.json",
        help="tensor-parallel plan (JSON) to apply instead of the build's",
    )
    data_parallel: DataParallelOptions = group(DataParallelOptions)
    training: TrainingOptions = group(TrainingOptions)

    def __post_init__(self) -> None:
        if not _is_int(self.steps) or self.steps < 1:
            raise ConfigError(f"--steps must be an int >= 1 (training steps), got {self.steps!r}")
        if self.schedule is not None and self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(
                f"unknown schedule {self.schedule!r}; expected one of {list(SCHEDULE_NAMES)}"
            )
        if self.virtual_stages is not None and (
            not _is_int(self.virtual_stages) or self.virtual_stages < 1
        ):
            raise ConfigError(
                f"--virtual-stages must be an int >= 1 (stages per rank), got {self.virtual_stages!r}; "
                "leave it out to use the build's"
            )
        for flag, value in (
            ("--microbatches", self.microbatches),
            ("--batch-size", self.batch_size),
        ):
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(
                    f"{flag} must be an int >= 1, got {value!r}; leave it out to use the build's"
                )
        if not _is_number(self.lr) or self.lr < 0:
            raise ConfigError(f"--lr must be a number >= 0 (the learning rate), got {self.lr!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"--precision must be one of {list(PRECISIONS)}, got {self.precision!r}"
            )
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile must be True or False, got {self.compile!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ConfigError(
                f"--compile-scope must be one of {list(COMPILE_SCOPES)}, got {self.compile_scope!r}"
            )
        if self.compile_backward not in COMPILE_BACKWARDS:
            raise ConfigError(
                f"--compile-backward must be one of {list(COMPILE_BACKWARDS)}, "
                f"got {self.compile_backward!r}"
            )
        if not _is_number(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(
                f"--timeout must be a positive number of seconds, got {self.timeout_s!r}"
            )
        if self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(
                f"--timeout must be at most {MAX_TIMEOUT_S:g} seconds (about 3 years; torch's process "
                f"groups count it in nanoseconds), got {self.timeout_s!r}"
            )
        if self.device is not None and not (
            isinstance(self.device, str) and _DEVICE.fullmatch(self.device)
        ):
            raise ConfigError(
                f"--device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}; "
                "leave it out to use cuda when available, else cpu"
            )
        if self.dp is not None and (not _is_int(self.dp) or self.dp < 1):
            raise ConfigError(
                f"--dp must be an int >= 1 (the number of pipeline replicas), got {self.dp!r}; "
                "use 1 for no data parallelism"
            )
        if not _is_int(self.tp) or self.tp < 1:
            raise ConfigError(
                f"--tp must be an int >= 1 (tensor-parallel ranks per stage), got {self.tp!r}"
            )
        if self.tp_plan is not None and self.tp == 1:
            raise ConfigError("--tp-plan applies with --tp T > 1; add --tp or drop --tp-plan")
        if not isinstance(self.data_parallel, DataParallelOptions):
            raise ConfigError(
                f"data_parallel must be DataParallelOptions, got {type(self.data_parallel).__name__}"
            )
        if not isinstance(self.training, TrainingOptions):
            raise ConfigError(
                f"training must be TrainingOptions, got {type(self.training).__name__}"
            )
        if (
            self.tp > 1
        ):  # what tensor parallelism does not combine with yet (docs/tensor-parallel.md)
            for what, given in (
                (  # FSDP over the stage's tp shards runs (Note [FSDP over TP]); ZeRO-1 does not
                    f"--shard {self.data_parallel.shard}",
                    self.data_parallel.shard == "optimizer",
                ),
                (
                    f"--comm-hook {self.data_parallel.comm_hook}",
                    self.data_parallel.comm_hook != "allreduce",
                ),
                (  # FSDP's mixed precision over tp shards: not tested yet
                    "--shard-param-dtype/--shard-reduce-dtype",
                    self.data_parallel.shard_param_dtype is not None
                    or self.data_parallel.shard_reduce_dtype is not None,
                ),
            ):
                if given:
                    raise ConfigError(
                        f"--tp {self.tp} does not combine with {what} yet; drop one of them"
                    )
        if (
            self.dp is not None
        ):  # else the runner checks against the world's replicas, before any communication
            self.data_parallel.check_replicas(self.dp)
        passes = self.data_parallel.backward_passes_per_step
        every = self.training.checkpoint_every
        if every is not None and every % passes:
            raise ConfigError(
                f"--checkpoint-every {every} is not a multiple of --backward-passes-per-step {passes}: "
                "a checkpoint inside an accumulation window would lose its gradients; use "
                f"--checkpoint-every {every - every % passes + passes}"
            )
        if self.steps % passes:
            raise ConfigError(
                f"--steps {self.steps} is not a multiple of --backward-passes-per-step {passes}: "
                f"the last {self.steps % passes} passes would accumulate gradients that are never "
                f"applied; use --steps {self.steps - self.steps % passes + passes}"
            )


# -- the command-line form -----------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the run flags (and ``--options JSON``) to ``parser``; ``run_options_from_args`` reads them back.

    A flag left out is absent from the namespace (its default lives in ``RunOptions``), so
    flags given together with ``--options`` override only what they name.
    """
    group = parser.add_argument_group("run options")
    group.add_argument(
        "--options",
        metavar="JSON",
        default=argparse.SUPPRESS,
        help="RunOptions as a JSON file (or JSON text), as fxpipe run writes for its workers; "
        "flags given too override it",
    )
    add_arguments(group, RunOptions, suppress=True)


def run_options_from_args(args: argparse.Namespace) -> RunOptions:
    """The ``RunOptions`` that ``add_run_arguments``' flags describe: the ``--options`` file
    (if any), overridden by the flags given, validated."""
    path = vars(args).get("options")
    data = load_json(path, "--options", ConfigError) if path is not None else {}
    for name, value in namespace_values(RunOptions, args).items():
        if name in _GROUPS and isinstance(data.get(name), dict):
            data[name] = {**data[name], **value}
        else:
            data[name] = value
    return RunOptions.from_dict(data)


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """The dotted option paths that ``add_run_arguments``' flags or the ``--options`` file set
    (``with_plan_defaults`` leaves those as given)."""
    paths: set[str] = set()
    for name, value in namespace_values(RunOptions, args).items():
        if name in _GROUPS:
            paths.update(f"{name}.{k}" for k in value)
        else:
            paths.add(name)
    path = vars(args).get("options")
    if path is not None:
        data = load_json(path, "--options", ConfigError)
        paths.update(k for k in data if k not in _GROUPS)
        for name in _GROUPS:
            paths.update(f"{name}.{k}" for k in data.get(name) or {})
        if (data.get("data_parallel") or {}).get("shard_optimizer_state"):
            paths.add("data_parallel.shard")
    return frozenset(paths)


def with_plan_defaults(
    options: RunOptions, plan: PartitionPlan | None, explicit: frozenset[str] = frozenset()
) -> RunOptions:
    """``options`` with the plan's configuration where they leave it open, so that a build runs
    as it was planned (``fxpipe plan/partition --devices`` or ``--dp``): ``dp`` left ``None`` is
    the plan's replicas (1 without a plan), and with 2+ replicas the plan's sharding level
    unless ``explicit`` (``explicit_fields``) names ``data_parallel.shard``.

    >>> with_plan_defaults(RunOptions(), plan).dp  # doctest: +SKIP
    2
    """
    planned = plan.cost.dp_replicas if plan is not None else 1
    replicas = options.dp if options.dp is not None else planned
    shard = options.data_parallel.shard
    if (
        plan is not None
        and replicas > 1
        and plan.cost.shard != "none"
        and shard == "none"
        and "data_parallel.shard" not in explicit
    ):
        shard = plan.cost.shard
    if replicas == options.dp and shard == options.data_parallel.shard:
        return options
    return replace(options, dp=replicas, data_parallel=replace(options.data_parallel, shard=shard))


# The nested option groups: field name -> its class.
_GROUPS = groups_of(RunOptions)
