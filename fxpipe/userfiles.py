"""The files a verb reads and writes: a regular file or one error line, and no output over an input.

Note [regular files only]: every file fxpipe reads that a user can name or replace (a
model file, a JSON artifact, a build's files, a checkpoint's record and parts, a
``--weights`` checkpoint) is opened through ``open_regular``: with ``O_NONBLOCK`` (opening a
FIFO that no one writes would wait forever, and reading it would block a run until its
timeout), then ``fstat`` on the open descriptor, so a FIFO, a device, a socket or a
directory is refused as one error, and what is read is the file that was checked.
Functions that take a path and open it themselves (``torch.load``, safetensors) are
given the checked descriptor's ``/proc/self/fd`` path, or are preceded by
``check_regular``. ``refuse_overwrite`` keeps an output (``--out``) off the files a verb
reads: ``fxpipe export ck --out ck/rank_0.pt`` would otherwise replace the checkpoint it
exported.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from fxpipe.errors import FxpipeError

__all__ = ["open_regular", "read_regular", "check_regular", "refuse_overwrite", "kind_of", "shown"]


def shown(path: str | Path) -> str:
    """``path`` for a message: as it is, or quoted with its newlines and control characters escaped, so a
    name like ``"b\\nerror: ..."`` cannot print a line of its own."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words ("a FIFO", "a directory", ...)."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refusal(
    path: str | Path, what: str, mode: int, error: type[FxpipeError], remedy: str
) -> FxpipeError:
    hint = f"; {remedy}" if remedy else ""
    return error(f"{what} {str(path)!r} is {kind_of(mode)}, not a regular file{hint}")


def open_regular(path: str | Path, what: str, error: type[FxpipeError], remedy: str = "") -> int:
    """A read-only descriptor of ``path``, refused with ``error`` unless it is a regular file; never blocks.

    ``FileNotFoundError`` propagates (callers say what a missing file means); another ``OSError``
    is ``error``. ``what`` names the file in the message ("checkpoint record", ...)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"cannot open {what} {str(path)!r}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refusal(path, what, mode, error, remedy)
    return fd


def read_regular(path: str | Path, what: str, error: type[FxpipeError], remedy: str = "") -> bytes:
    """The bytes of the regular file ``path`` (see ``open_regular``; ``FileNotFoundError`` propagates)."""
    fd = open_regular(path, what, error, remedy)
    try:
        with os.fdopen(fd, "rb") as f:
            return f.read()
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None


def check_regular(path: str | Path, what: str, error: type[FxpipeError], remedy: str = "") -> None:
    """Refuse ``path`` when it exists and is not a regular file (for a function that opens the path itself)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing: the reader says so in its own words
    if not stat.S_ISREG(mode):
        raise _refusal(path, what, mode, error, remedy)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.absolute() == b.absolute()


def refuse_overwrite(
    out: str | Path, inputs: Iterable[str | Path], option: str, error: type[FxpipeError]
) -> None:
    """Refuse writing ``out`` (given as ``option``) when it is one of ``inputs`` (the same file, also through a link
    or another name), or an input folder itself."""
    out_path = Path(out)
    for item in inputs:
        src = Path(item)
        if _same(out_path, src):
            raise error(
                f"{option} {str(out)!r} is {'the folder' if src.is_dir() else 'a file'} this command reads "
                f"({str(src)!r}); writing it would destroy its input, so choose another {option}"
            )
