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

Note [os._exit in user code]: ``os._exit(0)`` in a model file (at import, in
``build_model``, in a traced ``forward``) would end the process with status 0 having done
nothing, and no ``except`` can stop it. While fxpipe runs user code it replaces
``os._exit`` (and ``posix._exit``) with a function that raises ``ExitCalled``, a
``BaseException`` like ``SystemExit``, in the thread that runs under ``exits_raise()``;
the CLI and the model-file loader then report it as one error line with a non-zero exit.
Any other thread's call, a call after the block, and a call in a process forked inside
it (``multiprocessing`` ends its children with ``os._exit``) end the process as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posix
import re
import signal
import sys
import sysconfig
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn, TextIO

__all__ = [
    "internal_error_line",
    "user_frame",
    "print_safely",
    "disk_error",
    "disk_error_line",
    "one_line",
    "ExitCalled",
    "exits_raise",
    "SignalStop",
]

_MAX_MESSAGE = 300

# errno -> what it says about the disk
_DISK_FAULTS = {
    errno.ENOSPC: "the disk is full: free space there, or write elsewhere",
    errno.EDQUOT: "the disk quota is used up: free space there, or write elsewhere",
    errno.EROFS: "the file system is read-only: write elsewhere",
    errno.EFBIG: "the file is larger than the file system allows: write elsewhere",
    errno.EIO: "the disk reported an input/output error: check the disk, or write elsewhere",
}
_OS_ERROR_NUMBER = re.compile(
    r"\(os error (\d+)\)"
)  # how Rust's std::io::Error (safetensors) names it


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


class SignalStop(BaseException):
    """A termination signal (``SIGTERM``, ``SIGHUP``) asked this process to stop; raised by the handler of a
    process that cleans up first (``fxpipe run``: Note [stopping fxpipe run] in ``fxpipe.runtime.launch.launcher``)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = (
            signal.Signals(signum).name
            if signum in signal.Signals._value2member_map_
            else str(signum)
        )
        super().__init__(f"stopped by {self.name}")


class ExitCalled(BaseException):
    """``os._exit(code)`` was called by code running under ``exits_raise()`` (Note [os._exit in user code])."""

    def __init__(self, code: int) -> None:
        super().__init__(f"os._exit({code!r}) was called")
        self.code = code


_REAL_EXIT = os._exit
_GUARDED = threading.local()
_LOCK = threading.Lock()
_ACTIVE = [0]  # blocks open in any thread; os._exit is replaced while this is > 0


def _exit(status: int) -> NoReturn:
    if getattr(_GUARDED, "depth", 0):
        raise ExitCalled(status)
    _REAL_EXIT(status)


def _forked() -> None:
    """A forked child (multiprocessing, a compile worker) ends with ``os._exit``: it must really end there."""
    _GUARDED.depth = 0


os.register_at_fork(after_in_child=_forked)


@contextlib.contextmanager
def exits_raise() -> Iterator[None]:
    """Inside the block, ``os._exit(code)`` called by this thread raises ``ExitCalled(code)``."""
    with _LOCK:
        if _ACTIVE[0] == 0:
            os._exit = posix._exit = _exit
        _ACTIVE[0] += 1
    _GUARDED.depth = getattr(_GUARDED, "depth", 0) + 1
    try:
        yield
    finally:
        _GUARDED.depth -= 1
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                os._exit = posix._exit = _REAL_EXIT


def _message(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"sys.exit({exc.code!r}) was called"
    if isinstance(exc, ExitCalled):
        return str(exc)
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
    return (
        f"OSError [Errno {number} {name}] {fault.strerror or os.strerror(number)}{where} while {phase}: "
        f"{_DISK_FAULTS[number]}"
    )


def internal_error_line(exc: BaseException, phase: str) -> str:
    """The one line (no ``error:`` prefix) that stands for ``exc``, raised while ``phase`` ran (a disk
    fault: ``disk_error_line``)."""
    disk = disk_error_line(exc, phase)
    if disk is not None:
        return disk
    frame = user_frame(exc)
    where = (
        f"at {Path(frame.filename).name}:{frame.lineno} in {frame.name}; "
        if frame is not None
        else ""
    )
    return f"internal error while {phase}: {_message(exc)} ({where}rerun with --debug)"


def one_line(text: str) -> str:
    """``text`` with every character that is not printable escaped (``\\n``, ``\\x1b``, ...), so a path or a
    message that holds a newline prints as one line and cannot forge another (``error: ...``)."""
    return (
        text
        if text.isprintable()
        else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    )


def print_safely(line: str, stream: TextIO | None = None) -> None:
    """Print ``line`` to ``stream`` (default stderr), ignoring a closed or broken stream."""
    out = stream if stream is not None else sys.stderr
    try:
        print(line, file=out, flush=True)
    except (OSError, ValueError):
        pass
