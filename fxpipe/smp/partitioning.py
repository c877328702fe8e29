"""Partitioning at the first step: the CLI's tracer -> partitioner -> codegen path, run in-process.

Note [one plan for every rank]: global rank 0 traces the model on the first step's
first microbatch, plans, and writes a build directory (``write_build_dir``, which first
checks the stages against the model in train and eval mode) into a temporary folder, which it reads into memory and removes at once; it then scatters to
each rank the manifest, the plan and that rank's own stage files (source and weights).
A rank loads its stage from those bytes in memory (``CheckedBuild.from_memory``,
hash-checked like any build directory), so a build made at the first step leaves nothing
on disk, even when the process is killed later (``SIGKILL``, ``os._exit``); only rank 0's
folder exists while it is written, named with its pid, and a later first step removes
such folders of processes that are gone. So every rank runs the same plan,
even with measured (non-deterministic) unit times, and no rank holds another stage's
weights. A failure on rank 0 (a contradictory pin, an untraceable op) is sent to every
rank and raised there, so no rank hangs. With ``plan=DIR`` every rank loads its stage
from ``DIR`` instead.

Each stage's parameters and buffers are then set from the *local* wrapped module
(the same keys: a stage keeps the original names), so a prebuilt ``plan`` trains the
user's weights, and ``load_state_dict`` calls made before partitioning hold. A model built
on meta has no values to give: its stage initialises itself (Note [each stage initialises
itself] in ``fxpipe.codegen.stage_init``), and with the config's ``weights`` every rank then
reads its own stage's tensors from that checkpoint, one at a time, after checking its keys
against the whole (meta) model; so no rank holds more than its stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.codegen import CheckedBuild, Manifest, load_stage, write_build_dir
from fxpipe.codegen.checkpoint_weights import load_into_stage
from fxpipe.codegen.load import load_checked_stage
from fxpipe.errors import ConfigError, FxpipeError, WeightsError
from fxpipe.partitioner import CostModel, PartitionPlan, plan_partition
from fxpipe.runtime.pipeline.rank_stages import share_tied_parameters
from fxpipe.partitioner.schedule import schedule_kind
from fxpipe.runtime.dataparallel.fsdp_units import compile_regions
from fxpipe.runtime.pipeline.compiled import compile_rank_stages, warm_up_rank_stages
from fxpipe.runtime.pipeline.compiled_check import CompiledMismatchError
from fxpipe.runtime.pipeline.runner import COMPILE_CACHE, resolve_schedule
from fxpipe.smp.chunks import RankChunks
from fxpipe.smp.config import Config
from fxpipe.tracer import BuildRecord, ModelProfile, trace_model
from fxpipe.tracer.call import ModelInputs

__all__ = [
    "TraceOptions",
    "StageBuild",
    "build_stage",
    "compile_stages",
    "apply_partition_policy",
    "copy_module_values",
    "resolve_trace_device",
]


@dataclass(frozen=True)
class TraceOptions:
    """How rank 0 traces the model (the seed's ``DistributedModel`` tracing arguments)."""

    trace_device: str = "cpu"
    measure_times: bool = False
    measure_memory: bool = False
    check: bool = (
        True  # the compiler's safety net (Note [safety net] in fxpipe.codegen.check.safety)
    )
    # input dimensions besides the batch that follow the data (Note [dynamic dimensions]): one build
    # for every sequence length, e.g. {"input_ids": {1: ("seq", 2, 512)}}
    dynamic_dims: Mapping[str, Mapping[int, Any]] | None = None


@dataclass(frozen=True)
class StageBuild:
    """This rank's result of partitioning: the manifest, the plan, its stage module, and the build
    directory it was loaded from when that outlives the load (``plan=DIR``; ``None`` for a build
    made at the first step, see Note [one plan for every rank]). ``chunks``: stage index -> module
    of every stage this rank runs; with several (``virtual_stages``) ``stage`` is their ``RankChunks``."""

    manifest: Manifest
    plan: PartitionPlan | None
    stage: nn.Module
    build_dir: Path | None
    chunks: dict[int, nn.Module] = dataclasses.field(default_factory=dict)


def apply_partition_policy(profile: ModelProfile, config: Config) -> ModelProfile:
    """Pins as the seed defines them: ignored with ``auto_partition``; otherwise every unit
    inside a module keeps its ``partition(i)`` pin or gets ``default_partition``. Top-level
    glue ops (``module_path == ""``) stay free: the solver puts them where the pins allow."""
    units = []
    for u in profile.units:
        if config.auto_partition:
            pin = None
        else:
            pin = (
                u.pin
                if u.pin is not None
                else (config.default_partition if u.module_path else None)
            )
        if pin is not None and pin >= config.partitions:
            raise ConfigError(
                f"module {u.module_path!r} is in fxpipe.partition({pin}), but 'partitions' is "
                f"{config.partitions} (indices 0..{config.partitions - 1}); raise 'partitions' or "
                "change the partition index"
            )
        units.append(dataclasses.replace(u, pin=pin))
    return dataclasses.replace(profile, units=tuple(units))


_SHARED_FILES = ("manifest.json", "plan.json")  # what every rank gets besides its own stage's files


def _plan_on_rank0(
    module: nn.Module,
    inputs: ModelInputs,
    config: Config,
    options: TraceOptions,
    batch_size: int,
    record: BuildRecord | None,
    cost: CostModel | None,
) -> dict[int, dict[str, bytes]]:
    """Trace, plan and emit; the files each rank needs, by mp rank (read into memory, the folder removed)."""
    traced = trace_model(
        module,
        inputs,
        build_record=record,
        trace_device=options.trace_device,
        measure_times=options.measure_times,
        measure_memory=options.measure_memory,
        dynamic_dims=options.dynamic_dims,
        compile=config.compile,  # priced as the stages will run (Note [compiled unit times])
        progress=False,
    )
    traced.profile = apply_partition_policy(traced.profile, config)
    v = config.chunks_per_rank
    plan = plan_partition(
        traced.profile,
        config.partitions,
        schedule=config.schedule,
        microbatches=config.microbatches,
        optimize=config.optimize,
        cost=cost,
        virtual_stages=v if v > 1 else None,
    )
    _remove_orphaned_scratch()
    with tempfile.TemporaryDirectory(prefix=f"{_SCRATCH}{os.getpid()}-") as scratch:
        out_dir = Path(scratch) / "build"
        manifest = write_build_dir(
            traced,
            plan,
            out_dir,
            None,
            batch_size=batch_size,
            microbatches=config.microbatches,
            check=options.check,
        )
        shared = (
            (manifest.shared_source,) if manifest.shared_source else ()
        )  # the classes several stages use
        common = {name: (out_dir / name).read_bytes() for name in (*_SHARED_FILES, *shared)}
        by_rank: dict[
            int, dict[str, bytes]
        ] = {}  # a pipeline rank's files: those of every stage it runs
        for s, r in zip(manifest.stages, manifest.stage_ranks):
            files = by_rank.setdefault(r, dict(common))
            files.update(
                {
                    s.source: (out_dir / s.source).read_bytes(),
                    s.weights: (out_dir / s.weights).read_bytes(),
                }
            )
        return by_rank


_SCRATCH = "fxpipe-plan-"  # rank 0's folder while it writes the build: fxpipe-plan-<pid>-<random>


def _remove_orphaned_scratch() -> None:
    """Remove the build folders of first steps whose process was killed while writing one."""
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{_SCRATCH}*-*"):
        pid = folder.name[len(_SCRATCH) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process
        return True
    return True


def _scatter_build(
    files_by_stage: dict[int, dict[str, bytes]] | BaseException | None,
    rank: int,
    world: int,
    stage_of: Any,
) -> dict[str, bytes]:
    """Send each rank the files of its stages (or rank 0's error, raised everywhere)."""
    if world == 1:
        box: list[Any] = [files_by_stage]
    else:
        box = [None]
        payload = None
        if rank == 0:
            payload = [
                files_by_stage
                if isinstance(files_by_stage, BaseException)
                else files_by_stage[stage_of(r)]  # type: ignore[index]
                for r in range(world)
            ]
        dist.scatter_object_list(box, payload, src=0)
    got = box[0]
    if isinstance(got, BaseException):
        if rank == 0:
            raise got
        if isinstance(got, FxpipeError):
            raise type(got)(f"{got} (raised while rank 0 partitioned the model)")
        raise ConfigError(f"rank 0 failed to partition the model: {type(got).__name__}: {got}")
    if world == 1:
        return got[stage_of(0)]
    return got


def copy_module_values(stage: nn.Module, module: nn.Module, where: str) -> None:
    """Set every parameter and buffer of ``stage`` from ``module`` (same keys, same shapes)."""
    source: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    source.update(module.named_buffers(remove_duplicate=False))
    params = dict(stage.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for key, t in list(params.items()) + list(stage.named_buffers(remove_duplicate=False)):
            src = source.get(key)
            if src is None:
                if key in params:
                    raise ConfigError(
                        f"{where} has parameter {key!r}, which the wrapped model does not have: the "
                        "plan was built from another model; rebuild it with `fxpipe partition` or "
                        "drop 'plan'"
                    )
                continue  # a constant the stage computes itself
            if tuple(src.shape) != tuple(t.shape):
                raise ConfigError(
                    f"{where}: {key!r} has shape {tuple(t.shape)} but the wrapped model's is "
                    f"{tuple(src.shape)}; rebuild the plan from this model"
                )
            if src.is_meta:  # a model built on meta: the stage keeps its own (Note [each stage initialises itself])
                continue
            t.copy_(src)
            if key in params:
                t.requires_grad_(src.requires_grad)


def build_stage(
    module: nn.Module,
    inputs: ModelInputs,
    config: Config,
    options: TraceOptions,
    *,
    rank: int,
    world: int,
    mp_rank: int,
    device: torch.device,
    batch_size: int,
    stage_of: Any,
    on_trace: Any = None,
    record: BuildRecord | None = None,
    cost: CostModel | None = None,
) -> StageBuild:
    """Partition ``module`` (see Note [one plan for every rank]) and load this rank's stage on ``device``.

    ``record``: constructor arguments and pins of ``module``'s submodules, for leaf modules
    that a stage file must construct again. ``cost``: the cost model to plan with (it prices
    the data-parallel all-reduce of the run's replicas, hook and buckets).
    """
    if config.plan is not None:
        build_dir = Path(config.plan)
        manifest = Manifest.from_json(build_dir)
        if manifest.num_ranks != config.partitions:
            raise ConfigError(
                f"the plan {str(build_dir)!r} runs on {manifest.num_ranks} ranks but 'partitions' is "
                f"{config.partitions}; set 'partitions': {manifest.num_ranks} or rebuild with "
                f"`fxpipe partition --stages {config.partitions}`"
            )
        resolve_schedule(
            config.schedule, manifest, config.microbatches
        )  # the plan's chunks fit the pipeline
        plan = (
            PartitionPlan.from_json(build_dir / "plan.json")
            if (build_dir / "plan.json").is_file()
            else None
        )
        chunks = {
            s: load_stage(build_dir, s, device=device)
            for s in _rank_stage_indices(manifest, mp_rank)
        }
        where = f"pipeline rank {mp_rank} of {build_dir}"
    else:
        result: dict[int, dict[str, bytes]] | BaseException | None = None
        if rank == 0:
            try:
                if on_trace is not None:
                    on_trace(True)
                result = _plan_on_rank0(module, inputs, config, options, batch_size, record, cost)
            except Exception as exc:  # sent to every rank, raised on all
                result = exc
            finally:
                if on_trace is not None:
                    on_trace(False)
        files = _scatter_build(result, rank, world, stage_of)
        plan = PartitionPlan.from_json(files["plan.json"].decode())
        manifest, chunks = _load_stages_from_files(files, mp_rank, device, rank)
        build_dir, where = None, f"pipeline rank {mp_rank} of the plan made at the first step"
    share_tied_parameters(chunks, manifest)
    for chunk in chunks.values():
        copy_module_values(chunk, module, where)
    if (
        config.weights is not None
    ):  # each rank reads its own stages' tensors (Note [one plan for every rank])
        try:
            load_into_stage(chunks.values(), module, config.weights)
        except WeightsError as exc:
            raise WeightsError(str(exc).replace("--weights", "config 'weights'", 1)) from None
    stage = next(iter(chunks.values())) if len(chunks) == 1 else RankChunks(chunks)
    stage.train(module.training)
    return StageBuild(manifest, plan, stage, build_dir, chunks)


def compile_stages(
    build: StageBuild, config: Config, *, world: int, device: torch.device, batch_size: int
) -> Callable[[], None] | None:
    """``config['compile']``: compile this rank's stages of ``build`` and warm them up (Note
    [compile scope] in ``fxpipe.runtime.pipeline.compiled``), after ``tensor_parallel_degree``
    split them (a stage compiles as it will run: DTensor parameters), with ``compile_eval`` the
    eval graphs too (Note [compiled eval graphs]); sharded stages compile
    inside their FSDP units and the warm-up returned runs once the wrap is done (Note [compiling
    under FSDP]). Errors name the config's keys."""
    chunks, manifest, check = build.chunks, build.manifest, not config.compile_unchecked
    replicas = world // (config.partitions * config.tensor_parallel_degree)
    regions = compile_regions(chunks, config.data_parallel, replicas)  # sharded: FSDP units
    mb_size = max(batch_size // config.microbatches, 1)
    with _seed_spelling():
        reports = compile_rank_stages(
            manifest,
            chunks,
            device,
            mb_size,
            split_backward=schedule_kind(config.schedule).split_backward,
            split_graphs=config.compile_backward == "halves",
            cache_dir=build.build_dir / COMPILE_CACHE if build.build_dir is not None else None,
            regions=regions,
            warm_up=regions is None,
            eval_graphs=config.compile_eval,
            check=check,
        )
    if regions is None:
        return None
    return functools.partial(
        _warm_up_sharded,
        manifest,
        chunks,
        device,
        mb_size,
        reports,
        eval_graphs=config.compile_eval,
        check=check,
        fsdp_dtypes=(
            config.data_parallel.shard_param_dtype,
            config.data_parallel.shard_reduce_dtype,
        ),
    )


@contextlib.contextmanager
def _seed_spelling() -> Iterator[None]:
    """A compiled stage's check failure (Note [checking a compiled stage at the warm-up]) with its
    remedies in the config's keys instead of ``fxpipe run``'s flags."""
    try:
        yield
    except CompiledMismatchError as exc:
        text = str(exc).replace("without --compile", "without config 'compile'")
        text = text.replace("pass --compile-unchecked", "set config 'compile_unchecked': True")
        text = text.replace("evaluate without --eval-every", "without config 'compile_eval'")
        raise CompiledMismatchError(text) from None


def _warm_up_sharded(*args: Any, **kwargs: Any) -> None:
    """``warm_up_rank_stages`` after the FSDP wrap, its errors in the config's keys."""
    with _seed_spelling():
        warm_up_rank_stages(*args, **kwargs)


def _rank_stage_indices(manifest: Manifest, mp_rank: int) -> list[int]:
    """The stages pipeline rank ``mp_rank`` runs (one, or ``virtual_stages`` of them)."""
    return [s for s, r in enumerate(manifest.stage_ranks) if r == mp_rank]


def _load_stages_from_files(
    files: dict[str, bytes], mp_rank: int, device: torch.device, rank: int
) -> tuple[Manifest, dict[int, nn.Module]]:
    """``load_stage`` of this rank's stages on ``files`` held in memory (hash-checked all the same):
    nothing is written, so a rank killed at any moment leaves nothing behind.

    The stages' sources stay readable for tracebacks and ``inspect``: ``linecache`` keeps
    them under the file names their code was compiled with.
    """
    manifest = Manifest.from_json(files["manifest.json"].decode())
    indices = _rank_stage_indices(manifest, mp_rank)
    build = CheckedBuild.from_memory(
        files, indices, Path(tempfile.gettempdir()) / f"fxpipe-first-step-r{rank}"
    )
    chunks = {}
    for index in indices:
        chunks[index] = load_checked_stage(build, index, device=device)
        source = build.source(index)
        text = (source.data or b"").decode()
        # mtime None: linecache.checkcache keeps the entry although there is no such file
        linecache.cache[str(source.path)] = (
            len(text),
            None,
            text.splitlines(keepends=True),
            str(source.path),
        )
    return build.manifest, chunks


def resolve_trace_device(trace_device: str) -> str:
    """The seed's ``"gpu"``/``"cpu"`` as a torch device type; ``"gpu"`` without CUDA warns and uses the CPU."""
    if trace_device in ("gpu", "cuda"):
        if torch.cuda.is_available():
            return "cuda"
        warnings.warn(
            "trace_device='gpu' but CUDA is not available; tracing on the CPU", stacklevel=3
        )
        return "cpu"
    if trace_device != "cpu":
        raise ConfigError(f"trace_device must be 'gpu' or 'cpu', got {trace_device!r}")
    return "cpu"
