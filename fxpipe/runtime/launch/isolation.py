"""What a rank may import: the build's hash-checked files and installed packages, nothing found beside them.

Note [isolated workers]: a rank imports the build's files only from the bytes it hashed
(Note [check before use] in ``fxpipe.codegen.integrity``), and everything else from
installed packages. ``python -m`` puts the current directory first on ``sys.path``, and
an empty or relative ``PYTHONPATH`` entry (``PYTHONPATH=$PYTHONPATH:/x`` with nothing
before the colon) does too, so a ``safetensors.py`` or ``numpy.py`` planted in a build
directory a job is started from would run in every rank in place of the real one. So
``fxpipe run`` starts torchrun's agent and its workers with ``PYTHONSAFEPATH=1`` (``python
-P``: no current directory first) and a ``PYTHONPATH`` whose entries are absolute and never
the build directory (``isolated_env``), and the agent and each worker first drop such
entries from their own ``sys.path`` (``isolate_sys_path``, before any other import: a worker
started by a user's own torchrun is isolated too). When fxpipe itself was found only
through the current directory (run from its source folder), that folder is kept.

This module imports nothing but the standard library: it runs before anything else.
"""

from __future__ import annotations

import os
import sys

__all__ = ["isolate_sys_path", "isolated_env"]


def _real(entry: str, cwd: str) -> str:
    return os.path.realpath(os.path.join(cwd, entry))


def _fxpipe_root() -> str:
    """The folder that holds the ``fxpipe`` package (this file is ``fxpipe/runtime/launch/isolation.py``)."""
    return os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    )


def isolate_sys_path(build_dir: str | None) -> None:
    """Drop from ``sys.path`` the current directory ``python -m`` put first, and every entry that is the build
    directory (Note [isolated workers])."""
    cwd = os.getcwd()
    build = os.path.realpath(build_dir) if build_dir else None
    root = _fxpipe_root()
    keep = []
    for i, entry in enumerate(sys.path):
        first = i == 0 and not sys.flags.safe_path and entry in ("", cwd)
        real = _real(entry, cwd)
        if (first and real != root) or (build is not None and real == build):
            continue
        keep.append(entry)
    sys.path[:] = keep


def isolated_env(env: dict[str, str], build_dir: str) -> dict[str, str]:
    """``env`` for the agent and the workers (Note [isolated workers]): ``PYTHONSAFEPATH=1``, and ``PYTHONPATH``
    with absolute entries only, none of them the build directory, fxpipe's own folder first when it is the
    current directory."""
    cwd = os.getcwd()
    build, root = os.path.realpath(build_dir), _fxpipe_root()
    entries = [str(root)] if os.path.realpath(cwd) == root else []
    for entry in env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []:
        real = _real(entry or ".", cwd)  # an empty entry is the current directory
        if real != build and real not in entries:
            entries.append(real)
    out = {**env, "PYTHONSAFEPATH": "1"}
    if entries:
        out["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        out.pop("PYTHONPATH", None)
    return out
