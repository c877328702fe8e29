"""Tie a process's life to its parent's: when the parent dies, so does the child, within a second.

``fxpipe run`` starts torchrun's agent, which starts one worker per rank, each in its own
session (torch's elastic launcher calls ``Popen(start_new_session=True)``), so a signal to
the launcher's process group does not reach the workers, and a killed agent would leave
them training on. ``tie_to_parent`` makes the kernel kill this process when its parent
dies (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``); where that is not available, a daemon
thread polls ``os.getppid()`` twice a second instead. Either way, a parent that died before
the call is noticed at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["tie_to_parent", "PARENT_PID_ENV"]

PARENT_PID_ENV = "FXPIPE_PARENT_PID"  # set by a parent for the children it ties to itself
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while True:
        time.sleep(_POLL_S)
        if os.getppid() != parent:
            _die()


def tie_to_parent(expected_parent: int | None = None) -> str:
    """Make this process die with its parent; returns how (``"prctl"`` or ``"watchdog"``).

    ``expected_parent``: the parent's pid as the parent announced it (e.g. in
    ``FXPIPE_PARENT_PID``); when this process's parent is already another one (the
    expected parent died and the process was re-parented), it dies now. Default: the
    current parent.
    """
    parent = os.getppid() if expected_parent is None else expected_parent
    how = "prctl" if _set_parent_death_signal() else "watchdog"
    if how == "watchdog":
        threading.Thread(target=_watch, args=(parent,), name="fxpipe-lifeline", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the death signal was armed
        _die()
    return how


def expected_parent_from_env() -> int | None:
    """The parent pid announced in ``FXPIPE_PARENT_PID``, if any and if it is a number."""
    value = os.environ.get(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None
