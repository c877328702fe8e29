"""A per-unit table of a profile for the terminal (rich)."""

from __future__ import annotations

from typing import Any

from fxpipe.tracer.profile import ModelProfile

__all__ = ["print_profile_table", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_profile_table(profile: ModelProfile, console: Any = None) -> None:
    """Print one row per unit: name, module path, type, output shape, fwd/bwd ms, params, activations."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=f"{len(profile.units)} units, batch {profile.batch_size}, "
        f"{profile.frontend} front end, {profile.timing} times on {profile.trace_device}"
        f"{', traced on meta' if profile.meta else ''}"
    )
    for column, justify in (
        ("unit", "left"),
        ("module path", "left"),
        ("type", "left"),
        ("output", "left"),
        ("fwd ms", "right"),
        ("bwd ms", "right"),
        ("params", "right"),
        ("activations", "right"),
        ("pin", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for u in profile.units:
        shapes = ", ".join("x".join(map(str, o.shape)) or "int" for o in u.outputs)
        table.add_row(
            u.name,
            u.module_path or "(top)",
            u.module_type or u.kind,
            shapes,
            f"{u.fwd_ms:.3f}",
            f"{u.bwd_ms:.3f}",
            format_bytes(u.param_bytes),
            format_bytes(u.activation_bytes),
            "" if u.pin is None else str(u.pin),
        )
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        "",
        f"{sum(u.fwd_ms for u in profile.units):.3f}",
        f"{sum(u.bwd_ms for u in profile.units):.3f}",
        format_bytes(profile.total_param_bytes),
        format_bytes(sum(u.activation_bytes for u in profile.units)),
        "",
    )
    console.print(table)
