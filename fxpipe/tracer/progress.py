"""Progress of the long phases (build the model, trace, count, solve, emit, check).

Library code marks its phases with :func:`phase` and its loops with
:func:`progress_iter`; they say nothing until the command line opens :func:`reporting`
for a verb. Then, when standard error is a terminal, the running phase shows a spinner,
its elapsed time and (for a loop) a bar there, and leaves one line when it ends; when it
is not (a pipe, a CI log) each phase prints exactly one plain line when it ends, with its
time, and nothing else, on the ``lines`` stream (the command line's standard output, so
that standard error holds nothing but the one error line when a verb fails). Outside :func:`reporting`, ``progress_iter(..., enabled=True)`` shows
a transient bar on a terminal, as it always did for library users.

Example::

    with reporting(sys.stderr):
        with phase("trace"):
            ...
        with phase("count") as p:
            for unit in progress_iter(units, "counting units", True, len(units)):
                ...
            p.detail = f"{len(units)} units"
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Iterator

__all__ = ["phase", "progress_iter", "reporting", "Phase", "note"]


@dataclass
class Phase:
    """One running phase: its name, an optional detail shown with its time (``"154 units"``)."""

    name: str
    detail: str = ""
    started: float = field(default_factory=time.perf_counter)
    _progress: Any = None  # rich Progress while it runs on a terminal
    _task: Any = None

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"fxpipe: {self.name}{detail} {self.seconds:.1f} s"


@dataclass
class _Reporter:
    stream: IO[str]  # where plain lines go
    terminal: bool
    console: Any = None
    current: Phase | None = None


_REPORTER: list[_Reporter] = []


@contextlib.contextmanager
def reporting(
    stream: IO[str], terminal: bool | None = None, lines: IO[str] | None = None
) -> Iterator[None]:
    """Report the phases run inside the block: live on ``stream`` when it is a terminal (``terminal``:
    default ``stream.isatty()``), else one plain line per phase on ``lines`` (default ``stream``)."""
    is_tty = bool(getattr(stream, "isatty", lambda: False)()) if terminal is None else terminal
    reporter = _Reporter(stream if is_tty or lines is None else lines, is_tty)
    if is_tty:
        from rich.console import Console

        reporter.console = Console(file=stream, force_terminal=True)
    _REPORTER.append(reporter)
    try:
        yield
    finally:
        _REPORTER.remove(reporter)


@contextlib.contextmanager
def phase(name: str) -> Iterator[Phase]:
    """Mark a long phase (see the module docstring); a phase inside another is shown as part of it."""
    current = Phase(name)
    reporter = _REPORTER[-1] if _REPORTER else None
    if reporter is None or reporter.current is not None:
        yield current
        return
    reporter.current = current
    if reporter.terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
        from rich.progress import TimeElapsedColumn

        current._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=reporter.console,
            transient=True,
        )
        current._progress.start()
        current._task = current._progress.add_task(name, total=None)
    ok = False
    try:
        yield current
        ok = True
    finally:
        reporter.current = None
        if current._progress is not None:
            current._progress.stop()
        if ok:  # a failed phase says nothing: its error is the line the user reads
            text = current.line()
            if reporter.terminal:
                reporter.console.print(f"[dim]{text}[/]", highlight=False)
            else:
                print(text, file=reporter.stream, flush=True)


def note(text: str) -> None:
    """Say ``fxpipe: <text>`` once, where the phases are reported (a step that begins and is not timed here,
    such as a job that reports its own phases); nothing outside :func:`reporting`."""
    reporter = _REPORTER[-1] if _REPORTER else None
    if reporter is None:
        return
    if reporter.terminal:
        reporter.console.print(f"[dim]fxpipe: {text}[/]", highlight=False, soft_wrap=True)
    else:
        print(f"fxpipe: {text}", file=reporter.stream, flush=True)


def progress_iter(
    items: Iterable[Any], description: str, enabled: bool, total: int
) -> Iterable[Any]:
    """``items``, advancing the running phase's bar on a terminal; outside :func:`reporting`, with a
    transient rich progress bar on a terminal when ``enabled``."""
    reporter = _REPORTER[-1] if _REPORTER else None
    if reporter is not None:
        running = reporter.current
        if running is None or running._progress is None:
            yield from items
            return
        running._progress.update(
            running._task, description=f"{running.name}: {description}", total=total, completed=0
        )
        for item in items:
            yield item
            running._progress.advance(running._task)
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not (enabled and console.is_terminal):  # never a stray line in a log
        yield from items
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
