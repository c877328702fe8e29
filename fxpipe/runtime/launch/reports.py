"""The job's side channel: each rank's error and the agent's failures, as JSON files in the job's folder.

Note [reports, not output]: ``fxpipe run`` never reads the workers' text output to decide
anything: a user's own log line (``error: [rank 0] ...``), or a path with a newline in a
message, could otherwise stop a healthy job or forge an error. The launcher names a
folder of its own (``JOB_DIR_ENV``, inside its ``fxpipe-run-*`` temporary folder); a rank
that fails writes ``error-<rank>.json`` there (its rank, the error's class name, the
message, the time), and the agent writes ``agent-failures.json`` (each failed rank's exit
code or signal). Each file is written whole (a temporary name, then a rename), so a
reader sees all of it or nothing. The output itself is only passed on to the user.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "JOB_DIR_ENV",
    "RankError",
    "write_rank_error",
    "read_rank_errors",
    "write_agent_failures",
    "read_agent_failures",
    "job_dir",
]

JOB_DIR_ENV = "FXPIPE_JOB_DIR"
_AGENT_FILE = "agent-failures.json"
_ERROR_PREFIX = "error-"


@dataclass(frozen=True)
class RankError:
    """What one rank reported: ``kind`` is an ``fxpipe.errors`` class name, or ``None`` for an
    unexpected error or an interrupt (``message`` then says which)."""

    rank: int | None
    kind: str | None
    message: str
    time: float


def job_dir() -> Path | None:
    """The folder this process reports into, when a launcher gave one."""
    value = os.environ.get(JOB_DIR_ENV)
    return Path(value) if value else None


def _write(path: Path, data: Any) -> None:
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # the launcher is gone with its folder: nobody to tell
        tmp.unlink(missing_ok=True)


def write_rank_error(folder: Path, rank: str, kind: str | None, message: str) -> None:
    """Report this rank's error into ``folder`` (one file per rank: a later report replaces it)."""
    _write(
        folder / f"{_ERROR_PREFIX}{rank}.json",
        {
            "rank": int(rank) if rank.isdigit() else None,
            "kind": kind,
            "message": message,
            "time": time.time(),
        },
    )


def read_rank_errors(folder: Path) -> list[RankError]:
    """The ranks' reports in ``folder``, earliest first."""
    out = []
    try:
        names = sorted(
            n for n in os.listdir(folder) if n.startswith(_ERROR_PREFIX) and n.endswith(".json")
        )
    except OSError:
        return []
    for name in names:
        try:
            d = json.loads((folder / name).read_text(encoding="utf-8"))
            out.append(
                RankError(
                    rank=d["rank"] if isinstance(d["rank"], int) else None,
                    kind=d["kind"] if isinstance(d["kind"], str) else None,
                    message=str(d["message"]),
                    time=float(d["time"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda e: e.time)


def write_agent_failures(folder: Path, failures: list[dict[str, Any]]) -> None:
    _write(folder / _AGENT_FILE, failures)


def read_agent_failures(folder: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads((folder / _AGENT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []
