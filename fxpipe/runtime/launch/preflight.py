"""Checks ``fxpipe run`` makes in the launching process, before torchrun starts any worker.

A bad model file found by a worker is a job of N failing processes; found here it is one
line. ``preflight`` loads the build's model file and checks what every rank would:
the functions the run needs are there, the batch splits into the microbatches, the
targets have a batch dimension of the batch's size, the first training (and eval) batch
binds to the build's inputs with the right batch size, the build directory can take
``run.json``, ``--checkpoint-dir`` can be written and holds nothing a save would replace
(Note [a run writes only its own checkpoints] in ``fxpipe.runtime.train.checkpoint``), and
a checkpoint to resume from was saved by as many ranks as this run starts, from this model
and optimizer, before ``--steps`` (Note [what a resume carries over] in
``fxpipe.runtime.train.resume``). It returns the options with ``--data`` paths made absolute
(the workers may start elsewhere).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import BuildDirError, CheckpointError, ModelFileError
from fxpipe.runtime.train.data import model_source, target_batch_dims
from fxpipe.runtime.train.data_iter import EVAL_FN, TRAIN_FN, RankInfo, batch_stream, find_batches
from fxpipe.runtime.pipeline.microbatch import check_divisible
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.log import check_tensorboard
from fxpipe.userfiles import check_regular

__all__ = ["preflight"]


def _absolute(spec: str | None) -> str | None:
    if spec is None:
        return None
    path, _, name = spec.rpartition(":")
    return f"{Path(path).resolve()}:{name}"


def _check_batch(
    fn: Any, manifest: Manifest, batch: int, dims: tuple[int | None, ...] | None, what: str
) -> None:
    """Draw the first batch of ``fn`` as replica 0 would and check its sizes."""
    info = RankInfo(
        rank=0,
        world_size=1,
        stage=0,
        num_stages=1,
        replica=0,
        replicas=1,
        needs_inputs=True,
        needs_targets=True,
    )
    try:
        inputs, targets = next(batch_stream(fn, manifest, batch, info, name=what))
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(
            f"{getattr(fn, '__name__', what)}({batch}, rank_info) raised "
            f"{type(exc).__name__}: {exc}"
        ) from None
    name = getattr(fn, "__name__", what)
    for spec, t in zip(manifest.inputs, inputs):
        if spec.batch_dim is not None and t.shape[spec.batch_dim] != batch:
            raise ModelFileError(
                f"{name}({batch}, rank_info) yielded input {spec.name!r} with "
                f"{t.shape[spec.batch_dim]} rows along its batch dim {spec.batch_dim}; yield one "
                f"replica's batch of {batch}"
            )
    if dims is None:
        return
    leaves = tree_leaves(targets)
    for leaf, d in zip(leaves, dims):
        if isinstance(leaf, torch.Tensor) and d is not None and leaf.shape[d] != batch:
            raise ModelFileError(
                f"{name}({batch}, rank_info) yielded targets of shape {tuple(leaf.shape)}: "
                f"{leaf.shape[d]} along the batch dim {d}, not {batch}"
            )


def preflight(
    build_dir: Path, manifest: Manifest, options: RunOptions, world_size: int
) -> RunOptions:
    """Check, in this process, what the workers would find wrong (see the module docstring)."""
    t = options.training
    check_tensorboard(t.tensorboard)
    t = replace(
        t,
        data=_absolute(t.data),
        eval_data=_absolute(t.eval_data),
        tensorboard=None if t.tensorboard is None else os.path.abspath(t.tensorboard),
    )
    options = replace(options, training=t)
    batch = options.batch_size or manifest.batch_size
    microbatches = options.microbatches or manifest.microbatches
    check_divisible(batch, microbatches)
    _check_writable(build_dir)
    if t.checkpoint_dir is not None or t.resume_from is not None:
        _check_checkpoint(build_dir, manifest, options, batch, microbatches, world_size)
    if not manifest.model_file:
        return options
    source = model_source(build_dir, manifest)
    dims = target_batch_dims(source, batch) if source.has_loss_fn else None
    for leaf, d in zip(
        tree_leaves(source.example_targets(batch)) if dims is not None else (), dims or ()
    ):
        if isinstance(leaf, torch.Tensor) and d is not None:
            check_divisible(leaf.shape[d], options.microbatches or manifest.microbatches)
    train_fn = find_batches(source, t.data, TRAIN_FN)
    if train_fn is not None:
        _check_batch(train_fn, manifest, batch, dims, TRAIN_FN)
    if t.eval_every is not None:
        eval_fn = find_batches(source, t.eval_data, EVAL_FN)
        if eval_fn is not None:
            _check_batch(eval_fn, manifest, batch, dims, EVAL_FN)
    return options


def _check_writable(build_dir: Path) -> None:
    """Refuse a build directory that cannot take ``run.json`` (found now, not after the last step)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".fxpipe-probe-", dir=build_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise BuildDirError(
            f"the build directory {build_dir} cannot be written ({exc.strerror or exc}), so this "
            "run's record (run.json) could not be saved there; make it writable, or copy the build "
            "(cp -r) somewhere you can write"
        ) from None


def _check_checkpoint(
    build_dir: Path,
    manifest: Manifest,
    options: RunOptions,
    batch: int,
    microbatches: int,
    world_size: int,
) -> None:
    """``--checkpoint-dir`` can be written and holds nothing a save would replace; a checkpoint to
    resume fits this run (the workers check the same again, and say what carries over)."""
    from fxpipe.runtime.train.checkpoint import check_checkpoint_dir
    from fxpipe.runtime.train.resume import build_identity, check_resume
    from fxpipe.runtime.train.run_record import build_sha256

    from fxpipe.runtime.train.checkpoint import RECORD_NAME

    from fxpipe.runtime.train.dcp_checkpoint import is_dcp
    from fxpipe.runtime.train.reshard_resume import check_layout_resume, resume_record

    t = options.training
    identity = build_identity(manifest, build_sha256(build_dir))
    replicas = options.dp if options.dp is not None else max(world_size // manifest.num_ranks, 1)
    same = (
        t.resume_from is not None
        and t.checkpoint_dir is not None
        and os.path.realpath(t.resume_from) == os.path.realpath(t.checkpoint_dir)
    )
    record = None
    if t.checkpoint_dir is not None:
        check_regular(
            Path(t.checkpoint_dir) / RECORD_NAME,
            "the checkpoint record",
            CheckpointError,
            "remove it, or choose another --checkpoint-dir",
        )  # Note [regular files only]
        record = check_checkpoint_dir(t.checkpoint_dir, t.resume or same)
    if t.resume_from is not None:  # Note [resuming into another layout]
        record = resume_record(t.resume_from)
        check_layout_resume(
            dict(record.meta), options, batch, microbatches, replicas, identity, t.resume_from
        )
        return
    if not t.resume or record is None:
        return
    assert t.checkpoint_dir is not None
    if is_dcp(dict(record.meta)):
        check_layout_resume(
            dict(record.meta),
            options,
            batch,
            microbatches,
            replicas,
            identity,
            t.checkpoint_dir,
            "--resume",
        )
        return
    if record.num_parts != world_size:
        raise CheckpointError(
            f"--resume: the checkpoint in {t.checkpoint_dir} was saved by {record.num_parts} "
            f"ranks, this run starts {world_size}; resume with the same stages and --dp"
        )
    if record.meta:
        check_resume(
            dict(record.meta),
            None,
            options,
            batch,
            microbatches,
            identity,
            t.checkpoint_dir,
        )
