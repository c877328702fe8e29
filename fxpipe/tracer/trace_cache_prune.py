"""Keeping the trace cache within its size budget: the least recently used traces are removed.

Note [the trace cache's budget]: the trace cache (Note [the trace cache] in
``fxpipe.tracer.trace_cache``) would grow by one entry per model, batch size and fxpipe or torch
version forever. As ccache and pip bound theirs, it has a size budget (``--trace-cache-gib``,
2 GiB by default): after a trace is stored, :func:`prune` removes the least recently used entries
until the rest fit. An entry's modification time is when it was last used: writing it sets it and
a hit touches it (``TraceCache.load``), so mtime order is least-recently-used order without an
index file that concurrent partitions would have to lock. The entry just written is kept even
when it alone is over the budget (the next partition of the same model reads it). Pruning runs
only after a write, so a hit costs no listing of the folder.

Concurrent partitions share the folder safely: entries are renamed into place whole, so a reader
never sees half a file, and a reader that opened an entry before another process removed it still
reads it whole (POSIX keeps an open file's data); one that finds it gone traces again. Pruning
tolerates every file vanishing under it (another process pruned it first). A writer killed between
creating its temporary file and renaming it leaves a ``.tmp-*`` file behind: those older than an
hour are removed (a live writer's is seconds old). The progress output says in one line what was
removed.

>>> Pruned(evicted=2, freed=3 * 2**20, kept=2**30, stale=0).line(2 * 2**30)
'trace cache: removed 2 least recently used traces (3 MiB) to stay within 2 GiB'
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from fxpipe.sizes import format_size

__all__ = ["Pruned", "prune", "TEMP_PREFIX", "STALE_TEMP_SECONDS"]

TEMP_PREFIX = ".tmp-"  # a trace being written; renamed to ``<key>.pt`` when whole
STALE_TEMP_SECONDS = 3600.0  # a temporary file older than this was left by a killed writer


@dataclass(frozen=True)
class Pruned:
    """What :func:`prune` removed: ``evicted`` entries of ``freed`` bytes, leaving ``kept`` bytes,
    and ``stale`` temporary files."""

    evicted: int = 0
    freed: int = 0
    kept: int = 0
    stale: int = 0

    def line(self, budget: int) -> str | None:
        """The progress line that says what was removed, or None when nothing was."""
        parts = []
        if self.evicted:
            traces = "trace" if self.evicted == 1 else "traces"
            parts.append(
                f"removed {self.evicted} least recently used {traces} ({format_size(self.freed)}) "
                f"to stay within {format_size(budget)}"
            )
        if self.stale:
            files = "file" if self.stale == 1 else "files"
            parts.append(f"removed {self.stale} temporary {files} left by an interrupted write")
        return "trace cache: " + "; ".join(parts) if parts else None


def _remove(path: str) -> bool | None:
    """Remove ``path``: True when this call removed it, False when it was gone already (another
    process removed it), None when it cannot be removed (it stays)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return True


def prune(folder: Path, budget: int, keep: str | None = None, now: float | None = None) -> Pruned:
    """Remove the least recently used entries (``*.pt``, oldest modification time first) of the
    trace cache ``folder`` until the rest total at most ``budget`` bytes, never the entry named
    ``keep``, and the temporary files older than :data:`STALE_TEMP_SECONDS` (Note [the trace
    cache's budget]). Files that vanish meanwhile are skipped; nothing here raises for them."""
    now = time.time() if now is None else now
    entries: list[tuple[float, str, int]] = []  # (last used, name, bytes)
    stale = 0
    try:
        listing = list(os.scandir(folder))
    except OSError:
        return Pruned()
    for entry in listing:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:  # gone since the listing
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if entry.name.startswith(TEMP_PREFIX):
            if now - st.st_mtime > STALE_TEMP_SECONDS and _remove(entry.path):
                stale += 1
        elif entry.name.endswith(".pt") and not entry.name.startswith("."):
            entries.append((st.st_mtime, entry.name, st.st_size))
    total = sum(size for _, _, size in entries)
    evicted = freed = 0
    for _, name, size in sorted(entries):
        if total <= budget:
            break
        if name == keep:
            continue
        removed = _remove(os.path.join(folder, name))
        if removed is None:
            continue
        total -= size
        if removed:
            evicted += 1
            freed += size
    return Pruned(evicted=evicted, freed=freed, kept=total, stale=stale)
