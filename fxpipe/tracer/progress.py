"""Progress display for long tracing phases."""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["progress_iter"]


def progress_iter(items: Iterable[Any], description: str, enabled: bool, total: int) -> Iterable[Any]:
    """``items`` with a rich progress bar when ``enabled``."""
    if not enabled:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
