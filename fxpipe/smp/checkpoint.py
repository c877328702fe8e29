"""``save`` / ``load``: the seed's checkpoint functions, committed whole, checked, and without pickled code.

``save(obj, f, partial=True)`` writes ``f"{f}_{mp_rank}"`` on every rank of the pipeline
(each stage's part; call it on every stage, e.g. on ``dp_rank() == 0``); ``partial=False``
writes ``f`` once, from global rank 0 (call it on every rank with the gathered
``state_dict()``s). With ``tensor_parallel_degree`` T > 1 ``local_state_dict()`` gathers a
stage's split tensors whole, so a stage's part is the same on its T ranks: tp index 0 writes
it, every tp rank may load it. The files are ``torch.save``'s own; beside them a commit record
(``f.partial.json`` / ``f.full.json``) holds each file's sha256. A set of parts is
committed together or not at all, a load checks its part's sha256 before reading it and
refuses parts of different saves (Note [checkpoint commit] in ``fxpipe.runtime.train.commit``), and
``load`` uses ``torch.load(weights_only=True)``: tensors, numbers, strings and containers
load; a file that would run pickled code is refused. A full checkpoint is memory-mapped
(``mmap=True``): loaded into a ``DistributedModel`` of a model built on meta, each rank
copies only its stage's tensors, so only their pages are read.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import CheckpointError
from fxpipe.runtime.train.commit import (
    CommitRecord,
    Part,
    check_part,
    clean_stale,
    new_token,
    publish,
    read_record,
    record_path,
    write_pending,
    write_record,
)
from fxpipe.smp.state import current
from fxpipe.userfiles import check_regular

__all__ = ["CheckpointError", "save", "load", "checkpoint_path"]


def checkpoint_path(f: str | os.PathLike[str], partial: bool) -> Path:
    """The file this rank reads or writes for ``f``."""
    return Path(f"{os.fspath(f)}_{current().mp_rank}") if partial else Path(f)


def _group(st: Any, partial: bool) -> tuple[Any, int]:
    """The process group whose ranks save/load the parts together, and its size (1: this process alone)."""
    group = getattr(st, "mp_group", None) if partial else None
    if group is None or not dist.is_initialized():
        return None, 1
    return group, dist.get_world_size(group)


def _gather(mine: dict[str, Any], group: Any, size: int, doing: str) -> list[dict[str, Any]]:
    """Every rank's ``mine``, in group order (the agreement of Note [checkpoint commit])."""
    if size == 1:
        return [mine]
    everyone: list[Any] = [None] * size
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{doing}: another rank of the pipeline did not answer ({first}); nothing was committed"
        ) from None
    return everyone


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename!r}" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


def save(
    obj: Any, f: str | os.PathLike[str], partial: bool = True, pickle_protocol: int = 2
) -> None:
    """Save ``obj`` like ``torch.save``: per stage (``partial``) or once for the whole model.

    Example::

        fxpipe.save({"model_state_dict": model.local_state_dict()}, "ckpt.pt", partial=True)  # ckpt.pt_<mp_rank>
    """
    st = current()
    if not partial and st.rank != 0:
        return
    tp_rank: int = getattr(st, "tp_rank", 0)
    if partial and tp_rank != 0:  # the tp ranks of a stage hold one part: tp index 0 writes it
        return
    path = checkpoint_path(f, partial)
    key = str(st.mp_rank) if partial else "0"
    record_file = record_path(f, partial)
    group, size = _group(st, partial)
    token, mine = new_token(), {"key": key, "ok": False}  # what this rank tells the others
    part: Part | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        committed = _quiet_record(record_file)
        clean_stale(
            path,
            keep=committed.parts[key].pending if committed and key in committed.parts else None,
        )
        part = write_pending(obj, path, token, pickle_protocol)
        mine.update(ok=True, token=token, part=part)
    except Exception as exc:  # a full disk, an object torch.save cannot write: agreed on below
        mine.update(error=_reason(exc))
    everyone = _gather(mine, group, size, f"saving checkpoint {os.fspath(f)}")
    failed = [m for m in everyone if not m["ok"]]
    if failed:
        if part is not None:
            (path.parent / part.pending).unlink(missing_ok=True)
        where = f" on the rank of stage {failed[0]['key']}" if partial else ""
        raise CheckpointError(
            f"saving checkpoint {os.fspath(f)} failed{where}: {failed[0]['error']}; no part of it "
            "was written, and the previous checkpoint (if any) is unchanged"
        )
    record = CommitRecord(
        id=everyone[0]["token"],
        partial=partial,
        num_parts=st.layout.num_stages if partial else 1,
        parts={m["key"]: m["part"] for m in everyone},
    )
    assert part is not None
    try:
        write_record(record_file, record, token)
    except OSError as exc:
        existing = _quiet_record(record_file)
        if (
            existing is None or existing.id != record.id
        ):  # not committed where this rank's part lives
            (path.parent / part.pending).unlink(missing_ok=True)
            raise CheckpointError(
                f"saving checkpoint {os.fspath(f)} failed: cannot write its record "
                f"{record_file}: {_reason(exc)}"
            ) from None
    try:
        publish(path, part)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {os.fspath(f)} was committed, but renaming {path.name} into place failed "
            f"({_reason(exc)}); the next load finishes it"
        ) from None


def _quiet_record(path: Path) -> CommitRecord | None:
    try:
        return read_record(path)
    except CheckpointError:
        return None


def _check_local(
    f: str | os.PathLike[str], path: Path, key: str, partial: bool, st: Any
) -> dict[str, Any]:
    """This rank's verdict on its part: the record id it belongs to, or why it cannot be loaded."""
    try:
        record = read_record(record_path(f, partial))
        if record is None:
            if not path.is_file():
                hint = (
                    f"was it saved with partial=True by a job with {st.layout.num_stages} partitions?"
                    if partial
                    else "was it saved with partial=False? a partial checkpoint's files end in _<mp_rank>"
                )
                raise CheckpointError(f"checkpoint file {str(path)!r} does not exist; {hint}")
            return {"key": key, "id": None}
        if record.partial != partial:
            raise CheckpointError(
                f"{record_path(f, partial)} describes a {'partial' if record.partial else 'full'} "
                f"checkpoint; load it with partial={record.partial}"
            )
        if partial and record.num_parts != st.layout.num_stages:
            raise CheckpointError(
                f"checkpoint {os.fspath(f)} was saved by a job with {record.num_parts} partitions, "
                f"this one has {st.layout.num_stages}; load it with {record.num_parts} partitions, "
                "or save and load a full checkpoint (partial=False)"
            )
        check_part(path, record, key)
        clean_stale(path)
        return {"key": key, "id": record.id}
    except CheckpointError as exc:
        return {"key": key, "error": str(exc)}


def load(f: str | os.PathLike[str], partial: bool = True, map_location: Any = None) -> Any:
    """Load what ``save`` wrote: this stage's file (``partial``) or the single full file.

    Call it on every rank (a partial load compares, over the pipeline's ranks, which save
    each part comes from). Raises ``CheckpointError`` for a missing, corrupted or torn
    checkpoint, or one that holds more than plain data.

    Example::

        checkpoint = fxpipe.load("ckpt.pt", partial=True)
        model.load_state_dict(checkpoint["model_state_dict"])
    """
    st = (
        current() if partial else None
    )  # a full checkpoint loads without fxpipe.init, as torch.load does
    path = checkpoint_path(f, partial)
    key = str(st.mp_rank) if st is not None else "0"
    group, size = _group(st, partial)
    everyone = _gather(
        _check_local(f, path, key, partial, st), group, size, f"loading checkpoint {os.fspath(f)}"
    )
    mine = next(m for m in everyone if m["key"] == key)
    if "error" in mine:
        raise CheckpointError(mine["error"])
    bad = next((m for m in everyone if "error" in m), None)
    if bad is not None:
        raise CheckpointError(
            f"the part of stage {bad['key']} cannot be loaded, so neither can this one: "
            f"{bad['error']}"
        )
    ids = {m["key"]: m["id"] for m in everyone}
    if len(set(ids.values())) > 1:
        raise CheckpointError(
            f"the parts of checkpoint {os.fspath(f)} come from different saves ({ids}): a save "
            "was interrupted or a part was replaced; refusing to load a torn checkpoint"
        )
    if mine["id"] is None:
        warnings.warn(
            f"checkpoint {path} has no commit record ({record_path(f, partial).name}; written by an older "
            "fxpipe or by torch.save), so it is loaded without checking that it is whole",
            stacklevel=2,
        )
    try:
        return _torch_load(path, map_location, mmap=not partial)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data ({first}); fxpipe loads "
            "checkpoints with weights_only=True so they cannot run code. Save only state dicts, "
            "tensors, numbers and strings"
        ) from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc


def _torch_load(path: Path, map_location: Any, mmap: bool) -> Any:
    """``torch.load(weights_only=True)``; a full checkpoint is memory-mapped, so a rank that takes only its
    stage's keys from it (a model built on meta) reads only those pages (a file in torch's legacy
    format cannot be mapped: read whole)."""
    check_regular(
        path, "checkpoint file", CheckpointError
    )  # never wait on a FIFO (Note [regular files only])
    if mmap:
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
    return torch.load(path, map_location=map_location, weights_only=True)
