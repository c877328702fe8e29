"""``Config``: the ``fxpipe.init`` configuration, with the seed library's keys plus ``plan``.

The seed library takes a plain dict (``{"partitions": 2, "microbatches": 4, ...}``);
``Config.from_dict`` validates it and refuses unknown keys and impossible values with a
``ConfigError`` that names the key, the value given, what is expected and a remedy.
The data-parallel keys (``comm_hook``, ``powersgd_rank``, ``shard``, ...) are not declared
here: they are ``DataParallelOptions``' seed keys (``seed_keys``, Note [options declared
once] in ``fxpipe.optionspec``), read into ``Config.data_parallel`` and checked there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from fxpipe.errors import ConfigError, ScheduleError
from fxpipe.optionspec import seed_keys
from fxpipe.partitioner.schedule import SCHEDULE_NAMES, schedule_kind
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.train.run_options import COMPILE_BACKWARDS, DEFAULT_COMPILE_BACKWARD

__all__ = ["Config", "PIPELINES"]

# the seed's pipeline names -> fxpipe's runtime schedules; fxpipe's own schedule names are accepted as they
# are, those with several stages (chunks) per process too (Note [chunked schedules in the seed API] in
# fxpipe.smp.chunks)
PIPELINES = {"simple": "gpipe", "interleaved": "1f1b", **{n: n for n in SCHEDULE_NAMES}}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Config:
    """Validated training configuration.

    ``partitions``: pipeline stages (required); ``microbatches``: per step (the batch is
    cut into this many equal parts); ``pipeline``: ``"simple"`` (GPipe: all forwards,
    then all backwards), ``"interleaved"`` (1F1B), or an fxpipe schedule
    (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``: zero bubble, the backward split into
    input and weight gradients; ``"interleaved-1f1b"``, ``"zbv"`` and ``"dualpipev"`` run several
    stages per process, placed loop- and V-style); ``virtual_stages``: stages (chunks) per process of
    those schedules (default: the schedule's least, 2; ``interleaved-1f1b`` takes 2 or more,
    ``zbv`` and ``dualpipev`` exactly 2), so the model is cut into ``partitions * virtual_stages``
    stages; ``auto_partition``: let the solver
    place units (``False``: honour ``fxpipe.partition(i)`` blocks and put everything
    else on ``default_partition``); ``optimize``: ``"speed"`` or ``"memory"``, passed
    to the planner; ``ddp``: allow data-parallel replicas (world = partitions x
    replicas, each stage wrapped in DDP over its data-parallel group; see
    docs/dataparallel.md); the keys ``comm_hook`` (the DDP communication hook by name:
    ``allreduce``, ``fp16``, ``bf16``, ``powersgd``, ``batched_powersgd``), ``powersgd_rank``,
    ``shard`` (shard training state over the data-parallel group: ``"optimizer"``:
    ``ZeroRedundancyOptimizer``; ``"grad-op"``, ``"full"``: FSDP2, for schedules with one stage per
    process and a whole backward), ``shard_reduce``, ``shard_wrap``, ``shard_min_params``,
    ``shard_param_dtype``, ``shard_reduce_dtype`` and ``shard_optimizer_state`` (the older spelling
    of ``"shard": "optimizer"``) are ``DataParallelOptions``' fields, held in ``data_parallel``; ``plan``: a build
    directory written by ``fxpipe partition`` to use instead of partitioning at the
    first step; ``weights``: a checkpoint each rank loads its own stage's tensors from right
    after partitioning, in the formats of ``fxpipe partition --weights`` (a ``.safetensors``
    file, a directory of safetensors shards, or a ``torch.save``d state dict), read one tensor
    at a time: with a model built on meta, no rank ever holds more than its stage. ``compile``:
    run this rank's stages under ``torch.compile``, compiled right after partitioning
    (docs/compile.md; ``fxpipe.runtime.pipeline.compiled``); ``compile_backward``: under a
    zero-bubble pipeline, each compiled backward as one graph (``"graph"``) or cut in an input
    and a weight half (``"halves"``, the default), as ``fxpipe run --compile-backward``;
    ``compile_unchecked``: run compiled stages that differ from their eager code at the warm-up's
    check (Note [checking a compiled stage at the warm-up]), as ``fxpipe run --compile-unchecked``;
    ``compile_eval``: compile (and check) the graphs an evaluation runs (eval mode, ``no_grad``)
    at the first step too, as ``fxpipe run --eval-every`` does, instead of at the first evaluation
    (Note [compiled eval graphs]).
    ``tensor_parallel_degree``: T ranks
    per stage that split its linears, as ``fxpipe run --tp T`` (the seed library's later key;
    world = partitions x T x replicas, tp innermost; docs/tensor-parallel.md).
    """

    partitions: int
    microbatches: int = 1
    pipeline: str = "interleaved"
    virtual_stages: int | None = None
    auto_partition: bool = True
    default_partition: int = 0
    optimize: str = "speed"
    ddp: bool = False
    plan: str | None = None
    weights: str | None = None
    compile: bool = False
    compile_backward: str = DEFAULT_COMPILE_BACKWARD
    compile_unchecked: bool = False
    compile_eval: bool = False
    tensor_parallel_degree: int = 1
    data_parallel: DataParallelOptions = field(default_factory=DataParallelOptions)

    def __post_init__(self) -> None:
        if not _is_int(self.partitions) or self.partitions < 1:
            raise ConfigError(
                f"config 'partitions' must be an int >= 1, got {self.partitions!r}; "
                "set it to the number of pipeline stages, e.g. {'partitions': 2}"
            )
        if not _is_int(self.microbatches) or self.microbatches < 1:
            raise ConfigError(
                f"config 'microbatches' must be an int >= 1, got {self.microbatches!r}; "
                "e.g. {'microbatches': 4} (the batch size must be a multiple of it)"
            )
        if self.pipeline not in PIPELINES:
            raise ConfigError(
                f"config 'pipeline' must be one of {sorted(PIPELINES)}, got {self.pipeline!r}; "
                "'simple' runs all forwards then all backwards (GPipe), 'interleaved' is 1F1B, "
                "'zb-h1' is zero bubble, 'interleaved-1f1b', 'zbv' and 'dualpipev' run 'virtual_stages' "
                "per process"
            )
        if self.virtual_stages is not None and (
            not _is_int(self.virtual_stages) or self.virtual_stages < 1
        ):
            raise ConfigError(
                f"config 'virtual_stages' must be an int >= 1, got {self.virtual_stages!r}; "
                "e.g. {'pipeline': 'interleaved-1f1b', 'virtual_stages': 2}"
            )
        try:
            schedule_kind(self.schedule).check_virtual(self.chunks_per_rank)
        except ScheduleError as exc:
            raise ConfigError(
                f"config 'virtual_stages': {str(exc).replace('--virtual-stages', 'virtual_stages')}"
            ) from None
        for key in ("auto_partition", "ddp", "compile", "compile_unchecked", "compile_eval"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"config {key!r} must be True or False, got {getattr(self, key)!r}"
                )
        if self.compile_backward not in COMPILE_BACKWARDS:
            raise ConfigError(
                f"config 'compile_backward' must be one of {list(COMPILE_BACKWARDS)}, got "
                f"{self.compile_backward!r}; e.g. {{'compile': True, 'compile_backward': 'halves'}}"
            )
        if not _is_int(self.default_partition) or not 0 <= self.default_partition < self.partitions:
            raise ConfigError(
                f"config 'default_partition' must be a partition index in 0..{self.partitions - 1}, "
                f"got {self.default_partition!r}"
            )
        if not _is_int(self.tensor_parallel_degree) or self.tensor_parallel_degree < 1:
            raise ConfigError(
                f"config 'tensor_parallel_degree' must be an int >= 1, got "
                f"{self.tensor_parallel_degree!r}; e.g. {{'tensor_parallel_degree': 2}}"
            )
        if not isinstance(self.data_parallel, DataParallelOptions):
            raise ConfigError(
                "config data_parallel must be DataParallelOptions, got "
                f"{type(self.data_parallel).__name__}"
            )
        if self.tensor_parallel_degree > 1 and self.data_parallel.shard != "none":
            raise ConfigError(
                f"config 'tensor_parallel_degree' {self.tensor_parallel_degree} runs DDP over the "
                f"replicas, not 'shard': {self.data_parallel.shard!r}; drop 'shard' or set "
                "'tensor_parallel_degree': 1"
            )
        if self.tensor_parallel_degree > 1 and self.data_parallel.comm_hook != "allreduce":
            raise ConfigError(
                f"config 'tensor_parallel_degree' {self.tensor_parallel_degree} runs DDP's plain "
                f"all-reduce, not 'comm_hook': {self.data_parallel.comm_hook!r}; drop 'comm_hook' "
                "or set 'tensor_parallel_degree': 1"
            )
        if self.tensor_parallel_degree > 1 and self.chunks_per_rank > 1:
            raise ConfigError(
                f"config 'tensor_parallel_degree' {self.tensor_parallel_degree} runs one stage per "
                f"process, but pipeline {self.pipeline!r} runs {self.chunks_per_rank}; use "
                "'interleaved' or 'simple'"
            )
        if self.optimize not in ("speed", "memory"):
            raise ConfigError(
                f"config 'optimize' must be 'speed' or 'memory', got {self.optimize!r}"
            )
        if self.plan is not None:
            if (
                not isinstance(self.plan, (str, Path))
                or not (Path(self.plan) / "manifest.json").is_file()
            ):
                raise ConfigError(
                    f"config 'plan' must be a build directory written by `fxpipe partition`, but "
                    f"{str(self.plan)!r} has no manifest.json; run `fxpipe partition MODEL_FILE "
                    f"--stages {self.partitions} --out DIR` first or drop 'plan'"
                )
            object.__setattr__(self, "plan", str(self.plan))
        if self.weights is not None:
            if not isinstance(self.weights, (str, Path)) or not Path(self.weights).exists():
                raise ConfigError(
                    f"config 'weights' must be a checkpoint file or directory, but {self.weights!r} "
                    "does not exist; pass a .safetensors file, a directory of safetensors shards or a "
                    "torch.save'd state dict, or drop 'weights'"
                )
            object.__setattr__(self, "weights", str(self.weights))

    def data_parallel_options(self, **ddp_options: Any) -> DataParallelOptions:
        """The data-parallel options: this config's hook and sharding keys plus ``DistributedModel``'s DDP options."""
        return replace(self.data_parallel, **ddp_options) if ddp_options else self.data_parallel

    @property
    def schedule(self) -> str:
        """The runtime schedule name (``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"interleaved-1f1b"``, ``"zbv"``)."""
        return PIPELINES[self.pipeline]

    @property
    def chunks_per_rank(self) -> int:
        """Stages (chunks) each process runs: ``virtual_stages``, or the schedule's least."""
        return (
            self.virtual_stages
            if self.virtual_stages is not None
            else schedule_kind(self.schedule).default_virtual
        )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None) -> Config:
        """Validate a user's config dict (``None`` or ``{}`` is refused: ``partitions`` is required)."""
        config = dict(config or {})
        data_parallel = seed_keys(DataParallelOptions)  # seed key -> DataParallelOptions field
        known = [f.name for f in fields(cls) if f.name != "data_parallel"] + list(data_parallel)
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; fxpipe.init accepts {known}")
        if "partitions" not in config:
            raise ConfigError(
                "config has no 'partitions': pass the number of pipeline stages, "
                "e.g. fxpipe.init({'partitions': 2, 'microbatches': 4})"
            )
        dp = DataParallelOptions(
            **{name: config.pop(key) for key, name in data_parallel.items() if key in config}
        )
        return cls(**config, data_parallel=dp)

    def check_world(self, world_size: int) -> int:
        """The number of data-parallel replicas for ``world_size`` processes (``ddp`` must allow more than one)."""
        tp = self.tensor_parallel_degree
        if tp > 1 and world_size % (self.partitions * tp):
            per = self.partitions * tp
            raise ConfigError(
                f"'partitions' {self.partitions} x 'tensor_parallel_degree' {tp} = {per} does not "
                f"divide the world size {world_size}; launch a multiple of {per} processes "
                f"(`torchrun --nproc-per-node {per} script.py`) or change 'tensor_parallel_degree'"
            )
        if world_size % self.partitions:
            raise ConfigError(
                f"'partitions' {self.partitions} does not divide the world size {world_size}; "
                f"launch a multiple of {self.partitions} processes "
                f"(`torchrun --nproc-per-node {self.partitions} script.py`) or change 'partitions'"
            )
        replicas = world_size // (self.partitions * tp)
        options = self.data_parallel
        shard = options.shard
        if replicas == 1 and shard != "none":
            raise ConfigError(
                f"config shards training state ('shard': {shard!r}) over the data-parallel replicas, but "
                f"{world_size} processes for {self.partitions} partitions is one data-parallel replica; "
                f"launch a multiple of {self.partitions} processes with 'ddp': True, or drop the key"
            )
        if options.fsdp and (
            self.chunks_per_rank > 1 or schedule_kind(self.schedule).split_backward
        ):
            # as the runtime (fxpipe.runtime.pipeline.runner): FSDP counts backwards through one stage per process
            what = (
                f"{self.chunks_per_rank} stages per process"
                if self.chunks_per_rank > 1
                else "a backward split into input and weight gradients"
            )
            raise ConfigError(
                f"'shard': {shard!r} (FSDP) runs one stage per process with a whole backward, but "
                f"pipeline {self.pipeline!r} runs {what}; use 'shard': 'optimizer' or 'none', "
                "or pipeline '1f1b'"
            )
        if replicas > 1 and not self.ddp:
            raise ConfigError(
                f"world size {world_size} is {replicas} copies of {self.partitions * tp} "
                f"{'partitions' if tp == 1 else 'ranks (partitions x tensor_parallel_degree)'}, "
                f"which needs 'ddp': True; or launch exactly {self.partitions * tp} processes"
            )
        return replicas
