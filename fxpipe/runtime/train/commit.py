"""A set of checkpoint files committed together or not at all, each with its sha256.

Note [checkpoint commit]: ``smp.save(obj, f, partial=True)`` writes one file per stage,
``f_<mp_rank>``, on different ranks (maybe different machines). Each rank first writes
its part to a hidden temporary file beside it (``.<name>.<token>.fxpipe-tmp``), flushed
to disk, and hashes it. The ranks then agree (one ``all_gather`` over the pipeline's
group): if any failed (a full disk, an error), every rank removes its temporary file and
raises, and the previous checkpoint is untouched. Otherwise each rank writes the same
commit record, ``<f>.partial.json`` (``<f>.full.json`` for ``partial=False``): an id, and
per part its file name, sha256, size and temporary name. Replacing the record (atomic,
``os.replace``) is the commit point; each rank then renames its temporary file into place.

A load checks its part against the record before ``torch.load`` reads it: a part whose
sha256 differs is refused (a flipped byte, a part of another checkpoint), except when the
save was cut off between the commit and the rename, where the load finishes the rename
("rolls forward") from the temporary file the record names. The ranks then compare the
record ids they read, so parts of two checkpoints never load together, even on machines
that each keep their own copy of the record. A killed save leaves only its hidden
temporary file, which the next save or load of that part removes. A checkpoint without a
record (written by an older fxpipe, or by ``torch.save``) loads with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from fxpipe.errors import CheckpointError
from fxpipe.schema import NonNegInt, read_dataclass
from fxpipe.userfiles import open_regular, read_regular

__all__ = [
    "Part",
    "CommitRecord",
    "record_path",
    "write_pending",
    "write_record",
    "read_record",
    "publish",
    "check_part",
    "clean_stale",
    "new_token",
    "RECORD_FORMAT",
]

RECORD_FORMAT = "fxpipe-checkpoint"
_TMP_SUFFIX = ".fxpipe-tmp"


@dataclass(frozen=True)
class Part:
    """One file of a checkpoint: its name (in the checkpoint's folder), sha256, size, and the
    temporary file it is renamed from."""

    file: str
    sha256: str
    bytes: NonNegInt
    pending: str


@dataclass(frozen=True)
class CommitRecord:
    """What a committed checkpoint consists of: ``parts`` by mp rank (``"0"`` for a full one), and
    ``meta``: plain JSON data about the whole checkpoint that its writer wants committed with it
    (``fxpipe run``: the step, the build and the options; Note [what a resume carries over] in
    ``fxpipe.runtime.train.resume``)."""

    id: str
    partial: bool
    num_parts: NonNegInt
    parts: dict[str, Part]
    format: str = RECORD_FORMAT
    version: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> CommitRecord:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CheckpointError(
                f"{where} is not valid JSON ({exc}); the checkpoint cannot be checked"
            ) from None
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise CheckpointError(f"{where} is not an fxpipe checkpoint record")
        return read_dataclass(cls, data, where, CheckpointError)


def record_path(f: str | os.PathLike[str], partial: bool) -> Path:
    """The commit record of checkpoint ``f`` (Note [checkpoint commit])."""
    return Path(f"{os.fspath(f)}.{'partial' if partial else 'full'}.json")


def new_token() -> str:
    return secrets.token_hex(8)


def _tmp(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}.{token}{_TMP_SUFFIX}"


def _sha256(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with os.fdopen(open_regular(path, "checkpoint file", CheckpointError), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Writer:
    """A file for ``torch.save`` that keeps the first ``OSError`` of a write (ENOSPC), which torch's
    writer would otherwise turn into an unhelpful RuntimeError."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.out.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.out.flush()


def write_pending(obj: Any, path: Path, token: str, pickle_protocol: int) -> Part:
    """``torch.save`` ``obj`` into the hidden temporary file of ``path``, on disk and hashed;
    an error removes it and propagates (``OSError`` for a full disk)."""
    tmp = _tmp(path, token)
    try:
        with open(tmp, "wb") as out:
            writer = _Writer(out)
            try:
                torch.save(obj, cast(BinaryIO, writer), pickle_protocol=pickle_protocol)
            except RuntimeError:
                if writer.error is not None:  # torch reports a failed write as "unexpected pos ..."
                    raise writer.error from None
                raise
            out.flush()
            os.fsync(out.fileno())
        sha, size = _sha256(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Part(file=path.name, sha256=sha, bytes=size, pending=tmp.name)


def write_record(path: Path, record: CommitRecord, token: str) -> None:
    """Replace the commit record at ``path`` whole (the commit point)."""
    tmp = _tmp(path, token)
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(record.to_json() + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def read_record(path: Path) -> CommitRecord | None:
    """The commit record at ``path``; ``None`` when there is none."""
    try:  # a FIFO in its place is refused, never waited on (Note [regular files only] in fxpipe.userfiles)
        text = read_regular(
            path,
            "the checkpoint record",
            CheckpointError,
            "remove it, or choose another --checkpoint-dir",
        ).decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"cannot read the checkpoint record {path}: {exc}") from None
    return CommitRecord.from_json(text, str(path))


def publish(path: Path, part: Part) -> None:
    """Rename ``part``'s temporary file to ``path`` (after the commit)."""
    os.replace(path.parent / part.pending, path)
    _fsync_dir(path.parent)


def _matches(path: Path, part: Part) -> bool | None:
    """Whether ``path`` holds exactly ``part`` (``None``: there is no such file)."""
    try:
        sha, size = _sha256(path)  # a FIFO or a directory in its place is refused
    except FileNotFoundError:
        return None
    return sha == part.sha256 and size == part.bytes


def check_part(path: Path, record: CommitRecord, key: str) -> None:
    """Refuse ``path`` unless it is part ``key`` of ``record`` (sha256 and size); finish a save cut
    off between its commit and its rename (Note [checkpoint commit])."""
    part = record.parts.get(key)
    if part is None or part.file != path.name:
        raise CheckpointError(
            f"{path} is not part of the checkpoint its record names (the record lists "
            f"{sorted(p.file for p in record.parts.values())}); refusing to load it"
        )
    found = _matches(path, part)
    if found:
        return
    pending = path.parent / part.pending
    if _matches(
        pending, part
    ):  # committed, but the save stopped before renaming this part into place
        try:
            publish(path, part)
        except FileNotFoundError:  # a replica loading the same part renamed it first
            pass
        found = _matches(path, part)
        if found:
            return
    if found is None:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is missing, but its record says it was saved"
        )
    raise CheckpointError(
        f"{path} does not match its checkpoint record (sha256 or size differ): the file is "
        "corrupted or belongs to another save; refusing to load it"
    )


def clean_stale(path: Path, keep: str | None = None) -> None:
    """Remove the hidden temporary files of ``path`` left by killed saves (all but ``keep``)."""
    pattern = re.compile(re.escape(f".{path.name}.") + r"[0-9a-f]+" + re.escape(_TMP_SUFFIX))
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if pattern.fullmatch(name) and name != keep:
            try:
                os.unlink(path.parent / name)
            except OSError:
                pass
