"""What a training run shows as it goes: a progress bar on a terminal, TensorBoard event files.

The lead rank prints one plain line per ``--log-every`` steps (``training.format_log_line``)
wherever its output goes. On a terminal ``fxpipe run`` also draws a progress bar: the
workers' output reaches the terminal through the launcher, line by line, so a worker
writes each step's progress as one ``PROGRESS_PREFIX`` line (only when the launcher set
``PROGRESS_ENV``, which it does when its own stdout is a TTY) and the launcher redraws
the bar in place from it (``render_progress``); piped output never sees those lines.

``--tensorboard DIR`` writes event files through ``torch.utils.tensorboard`` (it needs
the ``tensorboard`` package: ``pip install tensorboard``, or the ``fxpipe[tensorboard]`` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from typing import IO

from fxpipe.errors import ConfigError

__all__ = [
    "PROGRESS_PREFIX",
    "PROGRESS_ENV",
    "STARTED_ENV",
    "progress_line",
    "render_progress",
    "ProgressBar",
    "check_tensorboard",
    "TensorBoardLog",
    "start_up_note",
]

PROGRESS_PREFIX = "fxpipe-progress: "
PROGRESS_ENV = (
    "FXPIPE_PROGRESS"  # "1": the launcher draws a progress bar from the workers' progress lines
)
STARTED_ENV = (
    "FXPIPE_RUN_STARTED"  # when fxpipe run started the job (time.time()), for the start-up lines
)


def start_up_note(what: str) -> None:
    """Rank 0's line for a start-up phase under ``fxpipe run`` (Note [start-up phases] in
    ``fxpipe.runtime.launch.launcher``): ``fxpipe: <what> (12.3 s after launch)``; nothing elsewhere."""
    import time

    started = os.environ.get(STARTED_ENV)
    try:
        since = time.time() - float(started) if started else None
    except ValueError:
        since = None
    if since is not None:
        print(f"fxpipe: {what} ({since:.1f} s after launch)", flush=True)


def progress_wanted() -> bool:
    """Whether this worker's launcher draws a progress bar (its stdout is a terminal)."""
    return os.environ.get(PROGRESS_ENV) == "1"


def progress_line(done: int, total: int, loss: float, eta_s: float) -> str:
    """The line a worker writes after a step for the launcher's progress bar.

    >>> progress_line(3, 10, 2.5, 7.0)
    'fxpipe-progress: {"done": 3, "total": 10, "loss": 2.5, "eta_s": 7.0}'
    """
    return PROGRESS_PREFIX + json.dumps(
        {"done": done, "total": total, "loss": loss, "eta_s": eta_s}
    )


def render_progress(line: str, width: int = 30) -> str | None:
    """The bar for a ``progress_line`` (``None`` if the line is not one).

    >>> render_progress(progress_line(3, 10, 2.5, 67.0), width=10)
    '[###.......]    3/10  loss 2.500000  ETA 0:01:07'
    """
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        p = json.loads(line[len(PROGRESS_PREFIX) :])
        done, total, loss, eta = (
            int(p["done"]),
            int(p["total"]),
            float(p["loss"]),
            int(round(float(p["eta_s"]))),
        )
    except (TypeError, ValueError, KeyError):
        return None
    filled = width * min(max(done, 0), total) // max(total, 1)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done:4d}/{total}  loss {loss:.6f}  "
        f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
    )


def check_tensorboard(directory: str | None) -> None:
    """Refuse ``--tensorboard`` when the ``tensorboard`` package is missing (before any worker starts)."""
    if directory is None:
        return
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or fxpipe[tensorboard]), or leave --tensorboard out"
        )


class TensorBoardLog:
    """Scalars of a run in ``directory`` (``torch.utils.tensorboard.SummaryWriter``), by step."""

    def __init__(self, directory: str) -> None:
        check_tensorboard(directory)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """``values`` (tag: number, ``None`` skipped) at ``step``; tags like ``train/loss``."""
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class ProgressBar:
    """The launcher's side: draws the workers' progress lines as one bar, redrawn in place."""

    def __init__(self) -> None:
        self.drawn = False

    def draw(self, line: str, sink: IO[str]) -> bool:
        """Draw ``line`` if it is a progress line (and say so); before any other line, clear the bar."""
        bar = render_progress(line.rstrip("\n"))
        if bar is None:
            if self.drawn:
                sink.write("\r\033[K")
                self.drawn = False
            return False
        step = json.loads(line[len(PROGRESS_PREFIX) :])
        last = step["done"] >= step["total"]
        sink.write("\r\033[K" + bar + ("\n" if last else ""))
        sink.flush()
        self.drawn = not last
        return True
