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

A new option is a field here (or in a nested group such as ``DataParallelOptions``,
registered in ``_GROUPS``), its check in ``__post_init__`` and one row of ``_FLAGS``.
Building a parser with these flags imports neither torch nor OR-Tools: the CLI builds
every verb's parser at start-up.

>>> options = RunOptions(steps=4, schedule="gpipe", dp=2, data_parallel=DataParallelOptions(comm_hook="fp16"))
>>> RunOptions.from_json(options.to_json()) == options
True
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.errors import ConfigError
from fxpipe.jsonio import check_schema_version, dump_json, load_json, refuse_unknown_fields
from fxpipe.partitioner.schedule import SCHEDULE_NAMES
from fxpipe.runtime.dataparallel.options import (COMM_HOOKS, SHARD_DTYPES, SHARD_LEVELS, SHARD_REDUCE, SHARD_WRAP,
                                                DataParallelOptions)
from fxpipe.runtime.train.training_options import LR_SCHEDULES, OPTIMIZERS, PRECISIONS, TrainingOptions, parse_betas

if TYPE_CHECKING:
    from fxpipe.partitioner.plan import PartitionPlan

__all__ = ["RunOptions", "RUN_OPTIONS_SCHEMA_VERSION", "DEFAULT_SCHEDULE", "DEFAULT_TIMEOUT_S",
           "add_run_arguments", "run_options_from_args", "explicit_fields", "with_plan_defaults"]

RUN_OPTIONS_SCHEMA_VERSION = 1
DEFAULT_SCHEDULE = "1f1b"  # what a build that names no schedule runs (one stage per rank)
DEFAULT_TIMEOUT_S = 300.0

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How to train a build directory: steps, schedule, batch, learning rate, timeout, device, data
    parallelism, and the optimizer, data, eval, checkpoints and logs (``training``).

    ``steps`` optimizer steps with learning rate ``lr`` under ``schedule`` (one that runs on the
    build's ``virtual_stages`` stages per rank; both default to the build's), the batch of ONE
    pipeline replica (``batch_size``) cut into ``microbatches``; ``dp`` replicas of the
    pipeline kept in sync as ``data_parallel`` says; each stage's forward under autocast
    with ``precision="bf16"``; a peer silent for ``timeout_s`` seconds is an error.
    ``None`` fields are resolved later (see the module's Note).
    """

    steps: int = 10
    schedule: str | None = None
    virtual_stages: int | None = None
    microbatches: int | None = None
    batch_size: int | None = None
    lr: float = 0.01
    precision: str = "fp32"
    timeout_s: float = DEFAULT_TIMEOUT_S
    device: str | None = None
    dp: int | None = None
    data_parallel: DataParallelOptions = field(default_factory=DataParallelOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)

    def __post_init__(self) -> None:
        if not _is_int(self.steps) or self.steps < 1:
            raise ConfigError(f"--steps must be an int >= 1 (training steps), got {self.steps!r}")
        if self.schedule is not None and self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; expected one of {list(SCHEDULE_NAMES)}")
        if self.virtual_stages is not None and (not _is_int(self.virtual_stages) or self.virtual_stages < 1):
            raise ConfigError(f"--virtual-stages must be an int >= 1 (stages per rank), got {self.virtual_stages!r}; "
                              "leave it out to use the build's")
        for flag, value in (("--microbatches", self.microbatches), ("--batch-size", self.batch_size)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{flag} must be an int >= 1, got {value!r}; leave it out to use the build's")
        if not _is_number(self.lr) or self.lr < 0:
            raise ConfigError(f"--lr must be a number >= 0 (the learning rate), got {self.lr!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        if not _is_number(self.timeout_s) or self.timeout_s <= 0:
            raise ConfigError(f"--timeout must be a positive number of seconds, got {self.timeout_s!r}")
        if self.device is not None and not (isinstance(self.device, str) and _DEVICE.fullmatch(self.device)):
            raise ConfigError(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}; "
                              "leave it out to use cuda when available, else cpu")
        if self.dp is not None and (not _is_int(self.dp) or self.dp < 1):
            raise ConfigError(f"--dp must be an int >= 1 (the number of pipeline replicas), got {self.dp!r}; "
                              "use 1 for no data parallelism")
        if not isinstance(self.data_parallel, DataParallelOptions):
            raise ConfigError(f"data_parallel must be DataParallelOptions, got {type(self.data_parallel).__name__}")
        if not isinstance(self.training, TrainingOptions):
            raise ConfigError(f"training must be TrainingOptions, got {type(self.training).__name__}")
        if self.training.checkpoint_dir is not None and self.data_parallel.shard == "optimizer":
            raise ConfigError("--checkpoint-dir does not save ZeRO's optimizer shards (--shard optimizer) yet; use "
                              "--shard none, grad-op or full, or save with "
                              "fxpipe.runtime.dataparallel.save_stage_checkpoint in your own loop")
        if self.dp is not None:  # else the runner checks against the world's replicas, before any communication
            self.data_parallel.check_replicas(self.dp)
        passes = self.data_parallel.backward_passes_per_step
        every = self.training.checkpoint_every
        if every is not None and every % passes:
            raise ConfigError(f"--checkpoint-every {every} is not a multiple of --backward-passes-per-step {passes}: "
                              "a checkpoint inside an accumulation window would lose its gradients; use "
                              f"--checkpoint-every {every - every % passes + passes}")
        if self.steps % passes:
            raise ConfigError(f"--steps {self.steps} is not a multiple of --backward-passes-per-step {passes}: "
                              f"the last {self.steps % passes} passes would accumulate gradients that are never "
                              f"applied; use --steps {self.steps - self.steps % passes + passes}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data, nested groups as objects, with a ``schema_version``."""
        out: dict[str, Any] = {"schema_version": RUN_OPTIONS_SCHEMA_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if f.name in _GROUPS else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunOptions:
        """Inverse of ``to_dict``; missing keys take their defaults, unknown keys are refused."""
        check_schema_version(data, RUN_OPTIONS_SCHEMA_VERSION, "run options", ConfigError)
        values = {k: v for k, v in data.items() if k != "schema_version"}
        refuse_unknown_fields(cls, values, "run options", ConfigError)
        for name, group in _GROUPS.items():
            if isinstance(values.get(name), dict):
                values[name] = group.from_dict(values[name])
        return cls(**values)

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, source: str | Path) -> RunOptions:
        """Read options from a JSON file or JSON text."""
        return cls.from_dict(load_json(source, "run options", ConfigError))


# The nested option groups: field name -> its class (with to_dict / from_dict).
_GROUPS: dict[str, Any] = {"data_parallel": DataParallelOptions, "training": TrainingOptions}


# -- the command-line form -----------------------------------------------------


@dataclass(frozen=True)
class _Flag:
    """One command-line flag and the (dotted, for a nested group) field it sets."""

    flag: str
    path: str
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    none_means: str = ""
    switch: Any = None  # a flag without a value that sets the field to this (e.g. an alias of a choice)

    def default(self) -> Any:
        """The field's default, read from the dataclasses (without building one: that would validate)."""
        value: Any = None
        owner: type = RunOptions
        for part in self.path.split("."):
            f = next(f for f in fields(owner) if f.name == part)
            factory = f.default_factory
            value = factory() if callable(factory) else f.default
            owner = type(value)
        return value


_FLAGS = (
    _Flag("--steps", "steps", "training steps", int, "K"),
    _Flag("--schedule", "schedule", "pipeline schedule: %(choices)s", str, "NAME", choices=SCHEDULE_NAMES,
          none_means="the build's"),
    _Flag("--virtual-stages", "virtual_stages", "stages per rank; must be the build's (partition with "
          "--virtual-stages V to change it)", int, "V", none_means="the build's"),
    _Flag("--microbatches", "microbatches", "microbatches per step", int, "M", none_means="the build's"),
    _Flag("--batch-size", "batch_size", "batch of one pipeline replica per step", int, "B",
          none_means="the build's"),
    _Flag("--lr", "lr", "learning rate (the peak, with --warmup-steps / --lr-schedule)", float, "LR"),
    _Flag("--precision", "precision", "each stage's forward and the loss under autocast: %(choices)s", str, "P",
          choices=PRECISIONS),
    _Flag("--optimizer", "training.optimizer", "torch.optim optimizer of every stage: %(choices)s", str, "NAME",
          choices=OPTIMIZERS),
    _Flag("--weight-decay", "training.weight_decay", "weight decay (AdamW: decoupled)", float, "WD"),
    _Flag("--betas", "training.betas", "Adam(W) betas, as B1,B2", parse_betas, "B1,B2"),
    _Flag("--warmup-steps", "training.warmup_steps", "steps of linear learning-rate warm-up", int, "K"),
    _Flag("--lr-schedule", "training.lr_schedule", "learning rate after the warm-up: %(choices)s", str, "NAME",
          choices=LR_SCHEDULES),
    _Flag("--clip-grad-norm", "training.clip_grad_norm", "clip the global gradient norm over all stages to X", float,
          "X", none_means="no clipping"),
    _Flag("--data", "training.data", "training batches: path.py:function(batch_size, rank_info) yielding "
          "(inputs, targets)", str, "FILE:FN", none_means="the model file's train_batches, else its example batch"),
    _Flag("--eval-data", "training.eval_data", "evaluation batches, as --data", str, "FILE:FN",
          none_means="the model file's eval_batches, else --data's batches"),
    _Flag("--eval-every", "training.eval_every", "evaluate every N steps (forward only, eval mode)", int, "N",
          none_means="never"),
    _Flag("--eval-steps", "training.eval_steps", "batches per evaluation", int, "K"),
    _Flag("--checkpoint-dir", "training.checkpoint_dir", "where checkpoints are written (and read with --resume)",
          str, "DIR", none_means="no checkpoints"),
    _Flag("--checkpoint-every", "training.checkpoint_every", "steps between checkpoints (one is written after the "
          "last step too)", int, "N", none_means="only after the last step"),
    _Flag("--resume", "training.resume", "continue from the checkpoint in --checkpoint-dir"),
    _Flag("--log-every", "training.log_every", "steps per log line", int, "N"),
    _Flag("--tensorboard", "training.tensorboard", "write TensorBoard event files (loss, lr, ...) into DIR", str, "DIR",
          none_means="none"),
    _Flag("--timeout", "timeout_s", "seconds before a silent peer is an error", float, "S"),
    _Flag("--device", "device", "cpu, cuda or cuda:N", str, "DEVICE",
          none_means="cuda:LOCAL_RANK when CUDA is available, else cpu"),
    _Flag("--dp", "dp", "data-parallel replicas of the pipeline: stages x R processes", int, "R",
          none_means="the plan's replicas with `fxpipe run`, WORLD_SIZE / stages under your own torchrun"),
    _Flag("--comm-hook", "data_parallel.comm_hook",
          f"DDP communication hook of the gradient all-reduce: {', '.join(COMM_HOOKS)}", str, "HOOK"),
    _Flag("--powersgd-rank", "data_parallel.powersgd_rank",
          "PowerSGD matrix approximation rank (with --comm-hook powersgd/batched_powersgd)", int, "K"),
    _Flag("--shard", "data_parallel.shard",
          "shard training state over the replicas: none, optimizer (ZeRO-1: ZeroRedundancyOptimizer), grad-op "
          "(gradients too: FSDP2, ZeRO-2), full (parameters too: FSDP2, ZeRO-3); default: the plan's with 2+ replicas, "
          "else none", str, "LEVEL", choices=SHARD_LEVELS),
    _Flag("--shard-optimizer-state", "data_parallel.shard",
          "the older spelling of --shard optimizer", switch="optimizer"),
    _Flag("--shard-reduce", "data_parallel.shard_reduce",
          "with --shard grad-op/full: reduce-scatter the gradients once per step or after every microbatch", str,
          "WHEN", choices=SHARD_REDUCE),
    _Flag("--shard-wrap", "data_parallel.shard_wrap",
          "with --shard grad-op/full: FSDP units: each block of the stage's module stacks, by --shard-min-params, "
          "or the whole stage", str, "POLICY", choices=SHARD_WRAP),
    _Flag("--shard-min-params", "data_parallel.shard_min_params",
          "with --shard-wrap params: parameters per FSDP unit (FairScale's auto_wrap)", int, "N", none_means="none"),
    _Flag("--shard-param-dtype", "data_parallel.shard_param_dtype",
          "with --shard grad-op/full: gather and compute in this dtype (MixedPrecisionPolicy)", str, "DTYPE",
          choices=SHARD_DTYPES, none_means="the parameters'"),
    _Flag("--shard-reduce-dtype", "data_parallel.shard_reduce_dtype",
          "with --shard grad-op/full: reduce-scatter the gradients in this dtype", str, "DTYPE",
          choices=SHARD_DTYPES, none_means="--shard-param-dtype's"),
    _Flag("--backward-passes-per-step", "data_parallel.backward_passes_per_step",
          "accumulate K steps' gradients locally before one all-reduce and optimizer step", int, "K"),
)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the run flags (and ``--options JSON``) to ``parser``; ``run_options_from_args`` reads them back.

    A flag left out is absent from the namespace (its default lives in ``RunOptions``), so
    flags given together with ``--options`` override only what they name.
    """
    group = parser.add_argument_group("run options")
    group.add_argument("--options", metavar="JSON", default=argparse.SUPPRESS,
                       help="RunOptions as a JSON file (or JSON text), as fxpipe run writes for its workers; "
                            "flags given too override it")
    for f in _FLAGS:
        default = f.default()
        if isinstance(default, bool) or f.switch is not None:  # a switch: its default is off
            group.add_argument(f.flag, dest=f.path, action="store_const", const=True if f.switch is None else f.switch,
                               default=argparse.SUPPRESS, help=f.help)
            continue
        shown = f.none_means if default is None else (f"{default:g}" if isinstance(default, float) else default)
        group.add_argument(f.flag, dest=f.path, type=f.type, metavar=f.metavar, choices=f.choices,
                           default=argparse.SUPPRESS, help=f"{f.help} (default: {shown})")


def run_options_from_args(args: argparse.Namespace) -> RunOptions:
    """The ``RunOptions`` that ``add_run_arguments``' flags describe: the ``--options`` file
    (if any), overridden by the flags given, validated."""
    given = vars(args)
    path = given.get("options")
    data = load_json(path, "--options", ConfigError) if path is not None else {}
    for f in _FLAGS:
        if f.path in given:
            *groups, name = f.path.split(".")
            target = data
            for part in groups:
                target = target.setdefault(part, {})
            target[name] = given[f.path]
    return RunOptions.from_dict(data)


def explicit_fields(args: argparse.Namespace) -> frozenset[str]:
    """The dotted option paths that ``add_run_arguments``' flags or the ``--options`` file set
    (``with_plan_defaults`` leaves those as given)."""
    given = vars(args)
    paths = {f.path for f in _FLAGS if f.path in given}
    path = given.get("options")
    if path is not None:
        data = load_json(path, "--options", ConfigError)
        paths.update(k for k in data if k not in _GROUPS)
        for name in _GROUPS:
            paths.update(f"{name}.{k}" for k in data.get(name) or {})
        if (data.get("data_parallel") or {}).get("shard_optimizer_state"):
            paths.add("data_parallel.shard")
    return frozenset(paths)


def with_plan_defaults(options: RunOptions, plan: PartitionPlan | None,
                       explicit: frozenset[str] = frozenset()) -> RunOptions:
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
    if (plan is not None and replicas > 1 and plan.cost.shard != "none" and shard == "none"
            and "data_parallel.shard" not in explicit):
        shard = plan.cost.shard
    if replicas == options.dp and shard == options.data_parallel.shard:
        return options
    return replace(options, dp=replicas, data_parallel=replace(options.data_parallel, shard=shard))
