"""One line for an exception nobody expected: what the CLI and each worker print instead of a traceback.

``internal_error_line(exc, "tracing")`` gives ``internal error while tracing: ValueError: msg
(at model.py:12 in forward; rerun with --debug)``: the phase that was running, the
exception's type and the first line of its message, and, when it was raised in the
user's code (a model file, a generated stage file: anything outside fxpipe, the standard
library and installed packages), the place it was raised. ``sys.exit()`` called by such
code reads as what it is.

A fault of the user's disk (full, over quota, read-only, failing) is no internal error:
``internal_error_line`` says so in one line, ``OSError`` and errno named, with the file when
known (``disk_error``: the ``OSError`` itself, one it was raised from, or an error of
safetensors' writer that carries its ``os error N``).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import TextIO

__all__ = ["internal_error_line", "user_frame", "print_safely", "disk_error", "disk_error_line"]

_MAX_MESSAGE = 300

# errno -> what it says about the disk
_DISK_FAULTS = {errno.ENOSPC: "the disk is full: free space there, or write elsewhere",
                errno.EDQUOT: "the disk quota is used up: free space there, or write elsewhere",
                errno.EROFS: "the file system is read-only: write elsewhere",
                errno.EFBIG: "the file is larger than the file system allows: write elsewhere",
                errno.EIO: "the disk reported an input/output error: check the disk, or write elsewhere"}
_OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error (safetensors) names it


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {str(Path(__file__).resolve().parent)}  # fxpipe itself
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if key in paths:
            roots.add(str(Path(paths[key]).resolve()))
    return tuple(sorted(roots))


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback in the user's code (see the module docstring)."""
    roots = _library_roots()
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        name = frame.filename
        if name.startswith("<"):
            continue
        try:
            resolved = str(Path(name).resolve())
        except (OSError, RuntimeError):
            resolved = name
        if not resolved.startswith(roots):
            found = frame
    return found


def _message(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r}) was called"
    lines = str(exc).strip().splitlines()
    text = lines[0].strip() if lines else ""
    if len(lines) > 1 or len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE].rstrip() + " …"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def disk_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` of a disk fault (``_DISK_FAULTS``) behind ``exc``: ``exc`` itself, an exception it
    was raised from (``__cause__`` / ``__context__``), or one that names ``(os error N)`` in its message
    (safetensors' ``SafetensorError``); ``None`` when there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FAULTS:
            return current
        match = _OS_ERROR_NUMBER.search(str(current))
        if match is not None and int(match.group(1)) in _DISK_FAULTS:
            number = int(match.group(1))
            return OSError(number, os.strerror(number))
        current = current.__cause__ or current.__context__
    return None


def disk_error_line(exc: BaseException, phase: str) -> str | None:
    """One line for a disk fault behind ``exc`` (see ``disk_error``), else ``None``.

    >>> disk_error_line(OSError(28, "No space left on device", "out/run.json"), "training")
    "OSError [Errno 28 ENOSPC] No space left on device: 'out/run.json' while training: the disk is full: free space there, or write elsewhere"
    """
    fault = disk_error(exc)
    if fault is None:
        return None
    number = fault.errno if fault.errno is not None else 0
    name = errno.errorcode.get(number, str(number))
    where = f": {fault.filename!r}" if fault.filename else ""
    return (f"OSError [Errno {number} {name}] {fault.strerror or os.strerror(number)}{where} while {phase}: "
            f"{_DISK_FAULTS[number]}")


def internal_error_line(exc: BaseException, phase: str) -> str:
    """The one line (no ``error:`` prefix) that stands for ``exc``, raised while ``phase`` ran (a disk
    fault: ``disk_error_line``)."""
    disk = disk_error_line(exc, phase)
    if disk is not None:
        return disk
    frame = user_frame(exc)
    where = f"at {Path(frame.filename).name}:{frame.lineno} in {frame.name}; " if frame is not None else ""
    return f"internal error while {phase}: {_message(exc)} ({where}rerun with --debug)"


def print_safely(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` to ``stream`` (default stderr), ignoring a closed or broken stream."""
    out = stream if stream is not None else sys.stderr
    try:
        print(line, file=out, flush=True)
    except (OSError, ValueError):
        pass
