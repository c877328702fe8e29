"""What the command line printed, without its progress lines (``fxpipe: <phase> (…) 1.2 s``, one per long
phase when standard error is not a terminal, ``fxpipe.tracer.progress``): error checks read the rest."""

from __future__ import annotations

import re

PROGRESS_LINE = re.compile(r"^fxpipe: [a-z ]+( \(.*\))? \d+\.\d s$")


def without_progress(err: str) -> str:
    """``err`` less the progress lines."""
    return "".join(line for line in err.splitlines(keepends=True) if not PROGRESS_LINE.match(line.rstrip("\n")))
