"""Byte counts as people read them, one spelling for every report and progress line.

>>> format_size(1536), format_size(3 * 2**20), format_size(2 * 2**30)
('1.5 KiB', '3 MiB', '2 GiB')
"""

from __future__ import annotations

__all__ = ["format_size"]


def format_size(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: binary units, three significant digits."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
