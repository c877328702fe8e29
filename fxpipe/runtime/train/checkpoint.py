"""Checkpoints of a training run: every rank's stage, optimizer, scheduler, step, RNG and data position.

``DIR/rank_<r>.pt`` per global rank (``torch.save`` of plain data: tensors, numbers,
strings), committed together through one record, ``DIR/checkpoint.json``, with
``fxpipe.runtime.train.commit``'s protocol (Note [checkpoint commit] there): each rank writes its
part to a hidden temporary file (fsynced), the ranks agree, the record is replaced (the
commit point) and the parts are renamed into place. Until the record is replaced the
previous checkpoint is whole and loadable; a load checks its part's sha256 against the
record and finishes a save cut off after its commit. ``load_training_checkpoint`` reads
with ``weights_only=True``.

A rank's part holds its stages' state dict under the original model's keys, so
``export_checkpoint`` can gather the replica-0 parts back into the original state dict
(``fxpipe export DIR --out model.safetensors``).

With ``--shard grad-op|full`` (FSDP2) each rank gathers its stage's parameters and
optimizer state into whole tensors before writing (collective over its data-parallel
group, through ``fxpipe.runtime.dataparallel.state_dict``), so a part has the same form
at every sharding level, and a resumed rank cuts its own shards back out of it, exactly.
Resuming is bit-for-bit on CPU: the parameters, the optimizer's and scheduler's state,
torch's and Python's RNG and the data position (Note [data position] in
``fxpipe.runtime.train.data_iter``) are all restored. The record's ``meta`` says after which
step, from which build and with which settings it was saved (Note [what a resume carries
over] in ``fxpipe.runtime.train.resume``).

Note [a run writes only its own checkpoints]: before the first step (in the launching process
and on every rank) ``check_checkpoint_dir`` makes sure the directory can be written, and that
a save will replace nothing this run did not write: a directory that holds a checkpoint is
refused unless the run resumes it, and parts without their record (``checkpoint.json`` lost)
are refused always, since nothing can check them and a save would write over them.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.errors import CheckpointError
from fxpipe.userfiles import check_regular, refuse_overwrite
from fxpipe.runtime.dataparallel.state_dict import (
    gather_if_sharded,
    load_stage_state_dict,
    shard_optimizer_state,
)
from fxpipe.runtime.train.numpy_rng import numpy_rng_state, set_numpy_rng_state
from fxpipe.runtime.train.commit import (
    CommitRecord,
    Part,
    check_part,
    clean_stale,
    new_token,
    publish,
    read_record,
    write_pending,
    write_record,
)
from fxpipe.runtime.train.dcp_checkpoint import is_dcp, read_model_state
from fxpipe.unexpected import disk_error

if TYPE_CHECKING:
    from fxpipe.runtime.pipeline.runner import PipelineRunner

__all__ = [
    "RECORD_NAME",
    "part_path",
    "read_part",
    "save_training_checkpoint",
    "load_training_checkpoint",
    "has_checkpoint",
    "training_state",
    "restore_training_state",
    "export_checkpoint",
    "gather_state_dict",
    "check_checkpoint_dir",
    "checkpoint_meta",
]

RECORD_NAME = "checkpoint.json"
FORMAT = "fxpipe-training-checkpoint"


def part_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.pt"


def has_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / RECORD_NAME).is_file()


def checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The ``meta`` the checkpoint in ``directory`` was committed with (``{}``: none, or an older fxpipe's)."""
    record = read_record(Path(directory) / RECORD_NAME)
    return dict(record.meta) if record is not None else {}


def check_checkpoint_dir(directory: str | Path, resume: bool) -> CommitRecord | None:
    """Refuse a ``--checkpoint-dir`` this run cannot write, or whose files a save would replace without
    this run having written them (Note [a run writes only its own checkpoints]); create it when missing.
    Returns the record of the checkpoint to resume (``None``: there is none)."""
    folder = Path(directory)
    flag = f"--checkpoint-dir {str(directory)!r}"
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(
            f"{flag} is a file, not a directory; name a directory for the checkpoints"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fxpipe-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointError(
            f"{flag} cannot be written ({exc.strerror or exc}); choose a directory this run can "
            "write, before any step is trained"
        ) from None
    record = read_record(folder / RECORD_NAME)
    parts = sorted(p.name for p in folder.glob("rank_*.pt")) + sorted(
        p.name for p in folder.glob("dcp-*") if p.is_dir()
    )  # per-rank files, or a model-keyed checkpoint's folder (fxpipe.runtime.train.dcp_checkpoint)
    if record is None and parts:
        raise CheckpointError(
            f"{flag} holds checkpoint parts ({', '.join(parts[:4])}{', ...' if len(parts) > 4 else ''})"
            f" but no {RECORD_NAME}, their record: they cannot be checked, so this run neither "
            f"resumes from them nor writes over them; restore {RECORD_NAME}, or move the parts away, "
            "or choose another --checkpoint-dir"
        )
    if record is not None and not resume:
        step = record.meta.get("step")
        raise CheckpointError(
            f"{flag} already holds a checkpoint{f' (after step {step})' if step is not None else ''};"
            " continue it with --resume, or choose another --checkpoint-dir: a new run does not write "
            "over it"
        )
    return record


def _everyone(mine: Any, world: int, doing: str) -> list[Any]:
    if world == 1 or not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, mine)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{doing}: another rank did not answer ({str(exc).strip()[:200]}); nothing was "
            "committed"
        ) from None
    return out


def save_training_checkpoint(
    directory: str | Path,
    rank: int,
    world: int,
    state: dict[str, Any],
    meta: dict[str, Any] | None = None,
) -> None:
    """Write ``state`` as rank ``rank``'s part of a checkpoint in ``directory``, committed with the
    other ranks' (collective over the world; Note [checkpoint commit] in ``fxpipe.runtime.train.commit``)
    and with ``meta`` in its record (the same on every rank)."""
    directory = Path(directory)
    path, record_file = part_path(directory, rank), directory / RECORD_NAME
    token, mine = new_token(), {"key": str(rank), "ok": False}
    part: Part | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        check_regular(
            record_file,
            "the checkpoint record",
            CheckpointError,
            "remove it, or choose another --checkpoint-dir",
        )  # never replaced, never waited on (Note [regular files only])
        committed = _quiet_record(record_file)
        keep = (
            committed.parts[str(rank)].pending
            if committed and str(rank) in committed.parts
            else None
        )
        clean_stale(path, keep=keep)
        part = write_pending({"format": FORMAT, **state}, path, token, pickle_protocol=2)
        mine.update(ok=True, token=token, part=part)
    except Exception as exc:  # a full disk: agreed on below, so no rank commits
        mine.update(error=f"{type(exc).__name__}: {exc}")
    everyone = _everyone(mine, world, f"saving a checkpoint into {directory}")
    failed = [m for m in everyone if not m["ok"]]
    if failed:
        if part is not None:
            (directory / part.pending).unlink(missing_ok=True)
        raise CheckpointError(
            f"saving a checkpoint into {directory} failed on rank {failed[0]['key']}: "
            f"{failed[0]['error']}; the previous checkpoint (if any) is unchanged"
        )
    assert part is not None
    record = CommitRecord(
        id=everyone[0]["token"],
        partial=True,
        num_parts=world,
        parts={m["key"]: m["part"] for m in everyone},
        meta=meta or {},
    )
    try:
        write_record(record_file, record, token)
    except OSError as exc:
        existing = _quiet_record(record_file)
        if existing is None or existing.id != record.id:  # not committed
            (directory / part.pending).unlink(missing_ok=True)
            raise CheckpointError(
                f"saving a checkpoint into {directory} failed: cannot write {RECORD_NAME}: "
                f"{exc.strerror or exc}; the previous checkpoint (if any) is unchanged"
            ) from None
    publish(path, part)


def _quiet_record(path: Path) -> CommitRecord | None:
    try:
        return read_record(path)
    except CheckpointError:
        return None


def read_part(directory: Path, rank: int, record: CommitRecord) -> dict[str, Any]:
    """Rank ``rank``'s part of the committed per-rank checkpoint ``record`` in ``directory``,
    checked against the record (sha256) and read with ``weights_only=True``."""
    path = part_path(directory, rank)
    check_part(path, record, str(rank))
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint part {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an fxpipe training checkpoint")
    return data


def _record(directory: Path) -> CommitRecord:
    record = read_record(directory / RECORD_NAME)
    if record is None:
        raise CheckpointError(
            f"no checkpoint in {directory} (it has no {RECORD_NAME}); train with --checkpoint-dir "
            f"{directory} first, or leave --resume out"
        )
    return record


def load_training_checkpoint(directory: str | Path, rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s part of the checkpoint in ``directory``, checked against its record (collective:
    every rank fails together)."""
    directory = Path(directory)
    mine: dict[str, Any] = {"rank": rank}
    data: dict[str, Any] = {}
    try:
        record = _record(directory)
        if record.num_parts != world:
            raise CheckpointError(
                f"the checkpoint in {directory} was saved by {record.num_parts} ranks, this run has "
                f"{world}; resume with the same stages and --dp"
            )
        data = read_part(directory, rank, record)
        mine["id"] = record.id
    except CheckpointError as exc:
        mine["error"] = str(exc)
    everyone = _everyone(mine, world, f"loading the checkpoint in {directory}")
    bad = next((m for m in everyone if "error" in m), None)
    if bad is not None:
        raise CheckpointError(
            bad["error"]
            if bad is mine
            else f"rank {bad['rank']} cannot load its part: {bad['error']}"
        )
    if len({m["id"] for m in everyone}) > 1:
        raise CheckpointError(
            f"the ranks read different checkpoints in {directory}; refusing a torn checkpoint"
        )
    return data


# -- a runner's state --------------------------------------------------------------------------------


def _cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def training_state(
    runner: PipelineRunner, step: int, data_position: int, history: dict[str, Any]
) -> dict[str, Any]:
    """What a rank saves: its stages, optimizer, scheduler, the step done, the data position, the RNG,
    the record so far (``history``) and where it sits in the job. Collective over the data-parallel
    group when the stage is sharded (FSDP's shards are gathered into whole tensors)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if runner.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(runner.device)
    numpy_state = numpy_rng_state()  # Note [numpy's stream in a checkpoint]
    if numpy_state is not None:
        rng["numpy"] = numpy_state
    return {
        "step": step,
        "data_position": data_position,
        "history": history,
        "rng": rng,
        "rank": runner.rank,
        "world_size": runner.world_size,
        "replica": runner.replica,
        "pipeline_rank": runner.pipeline_rank,
        "stages": sorted(runner.stages),
        "num_stages": runner.manifest.num_stages,
        "model": _cpu(gather_if_sharded(runner.state_dict())),
        "optimizer": gather_if_sharded(runner.optimizer.state_dict())
        if runner.optimizer is not None
        else {},
        "scheduler": runner.scheduler.state_dict() if runner.scheduler is not None else {},
        "scaler": runner.scaler.scaler.state_dict() if runner.scaler is not None else {},
    }


def restore_training_state(runner: PipelineRunner, state: dict[str, Any]) -> None:
    """Load what ``training_state`` saved back into ``runner`` (and this process's RNG)."""
    if (
        state["stages"] != sorted(runner.stages)
        or state["num_stages"] != runner.manifest.num_stages
    ):
        raise CheckpointError(
            f"the checkpoint holds stages {state['stages']} of {state['num_stages']} for rank "
            f"{state['rank']}, but this rank runs stages {sorted(runner.stages)} of "
            f"{runner.manifest.num_stages}; resume with the build it was saved from"
        )
    model = state["model"]
    for module in runner.stages.values():
        own = module.state_dict()
        missing = sorted(set(own) - set(model))
        if missing:
            raise CheckpointError(
                f"the checkpoint has no {missing[:4]}: it was saved from another build"
            )
        load_stage_state_dict(
            module, {k: model[k] for k in own}
        )  # each rank cuts out its own shards
    if runner.optimizer is not None:
        _check_optimizer_kind(state["optimizer"], runner.optimizer)
        runner.optimizer.load_state_dict(
            shard_optimizer_state(state["optimizer"], runner.optimizer)
        )
    if runner.scheduler is not None:
        runner.scheduler.load_state_dict(state["scheduler"])
    if runner.scaler is not None and state.get(
        "scaler"
    ):  # fp16's loss scale and its growth tracker
        runner.scaler.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if "cuda" in state["rng"] and runner.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], runner.device)
    if "numpy" in state["rng"]:  # a checkpoint written before it has none
        set_numpy_rng_state(state["rng"]["numpy"])


# hyperparameters that tell torch.optim's SGD from Adam(W): a state of one has none of the other's
_OPTIMIZER_KEYS = ("momentum", "dampening", "nesterov", "betas", "eps", "amsgrad")


def _check_optimizer_kind(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Refuse the saved state of another kind of optimizer (a checkpoint whose record has no ``meta``
    to say which; Note [what a resume carries over]), which would fail inside its first step."""
    groups = saved.get("param_groups") or []
    if not groups or not optimizer.param_groups:
        return
    ours, theirs = optimizer.param_groups[0], groups[0]
    differ = [k for k in _OPTIMIZER_KEYS if (k in ours) != (k in theirs)]
    if differ:
        raise CheckpointError(
            f"the checkpoint holds the state of another optimizer than this run's "
            f"{type(optimizer).__name__} (its hyperparameters differ: {', '.join(differ)}); resume "
            "with the --optimizer it was saved with, or start a new run with another --checkpoint-dir"
        )


# -- export ------------------------------------------------------------------------------------------


def gather_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a checkpoint: the union of replica 0's parts, under the
    original keys (every stage must be there)."""
    directory = Path(directory)
    record = _record(directory)
    if is_dcp(dict(record.meta)):  # Note [checkpoints keyed by the model]
        return read_model_state(directory)
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    num_stages = None
    for key in sorted(record.parts, key=int):
        part = read_part(directory, int(key), record)
        num_stages = part["num_stages"]
        if part["replica"] != 0:
            continue
        seen.update(part["stages"])
        state.update(part["model"])
    missing = sorted(set(range(num_stages or 0)) - seen)
    if missing:
        raise CheckpointError(f"the checkpoint in {directory} has no part for stages {missing}")
    return state


def export_checkpoint(directory: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Write the whole model's state dict of the checkpoint in ``directory`` to ``out`` (safetensors),
    loadable by ``build_model().load_state_dict(safetensors.torch.load_file(out))``; returns it.

    ``out`` is written whole or not at all, and never over a file of the checkpoint (Note [regular
    files only] in ``fxpipe.userfiles``)."""
    from safetensors.torch import save_file

    directory, target = Path(directory), Path(out)
    if not (directory / RECORD_NAME).exists() and not (directory / RECORD_NAME).is_symlink():
        what = "a build directory" if (directory / "manifest.json").exists() else "not a checkpoint"
        raise CheckpointError(
            f"{str(directory)!r} is {what} (it has no {RECORD_NAME}); `fxpipe export` reads the "
            f"--checkpoint-dir that `fxpipe run BUILD --checkpoint-dir DIR` wrote"
        )
    record = _record(directory)
    inputs = [
        directory,
        directory / RECORD_NAME,
        *(directory / p.file for p in record.parts.values()),
        *(directory / p.pending for p in record.parts.values()),
    ]
    refuse_overwrite(target, inputs, "--out", CheckpointError)
    if target.is_dir():
        raise CheckpointError(
            f"--out {str(out)!r} is a directory; name a file, e.g. {str(target / 'model.safetensors')!r}"
        )
    check_regular(target, "--out", CheckpointError, "name a new file or a regular one to replace")
    state = {k: v.contiguous().clone() for k, v in gather_state_dict(directory).items()}
    tmp = target.parent / f".{target.name}.{new_token()}.fxpipe-tmp"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp), metadata={"format": "pt", "source": "fxpipe export"})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(
            tmp, 0o666 & ~mask
        )  # safetensors writes 0600; a model file is shared like any other
        os.replace(tmp, target)
    except Exception as exc:
        fault = disk_error(
            exc
        )  # a full disk: an OSError that names the file (safetensors' error does not)
        if fault is not None:
            raise OSError(fault.errno, fault.strerror, str(out)) from None
        if isinstance(exc, OSError):
            raise CheckpointError(
                f"cannot write --out {str(out)!r}: {exc.strerror or exc}"
            ) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return state
