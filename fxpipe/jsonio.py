"""Reading and writing the JSON artifacts (profile, plan, manifest) in one way.

Each artifact carries an integer ``schema_version``; a newer one than this fxpipe knows
is refused with a message that says to upgrade, never half-read. Writing refuses
``NaN`` and infinities (JSON has no such numbers; Python would write ``NaN``/``Infinity``,
which other readers reject), naming the field that holds one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fxpipe.errors import FxpipeError
from fxpipe.schema import find_non_finite
from fxpipe.userfiles import read_regular

__all__ = ["dump_json", "load_json", "check_schema_version"]


def dump_json(
    data: dict[str, Any],
    path: str | Path | None = None,
    *,
    what: str = "data",
    error: type[FxpipeError] = FxpipeError,
) -> str:
    """``data`` as indented JSON text, also written to ``path`` when given.

    A ``NaN`` or infinite number anywhere in ``data`` raises ``error`` naming its field.
    """
    bad = find_non_finite(data)
    if bad is not None:
        raise error(f"{what} {bad} is not a finite number; refusing to write it as JSON")
    text = json.dumps(data, indent=1, allow_nan=False)
    if path is not None:
        Path(path).write_text(text + "\n")
    return text


def load_json(source: str | Path, what: str, error: type[FxpipeError]) -> dict[str, Any]:
    """Parse a JSON object from a path or from JSON text; ``what`` names it in errors.

    A ``Path`` is always a file (a folder named ``{exp1}`` too); a ``str`` is JSON text when it starts with ``{``."""
    text = str(source)
    if isinstance(source, Path) or not text.lstrip().startswith("{"):
        path = Path(source)
        try:  # a FIFO or a device is refused, never read (Note [regular files only] in fxpipe.userfiles)
            text = read_regular(path, f"{what} file", error).decode("utf-8")
        except FileNotFoundError:
            raise error(f"{what} file {str(path)!r} does not exist") from None
        except UnicodeDecodeError as exc:
            raise error(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def check_schema_version(
    data: dict[str, Any],
    supported: int,
    what: str,
    error: type[FxpipeError],
    *,
    oldest: int | None = None,
    remedy: str = "",
) -> int:
    """The artifact's schema version (``supported`` when it has none), refusing one that is
    not an integer, newer than ``supported`` or older than ``oldest`` (default: ``supported``);
    ``remedy`` says how to write a current one."""
    version = data.get("schema_version", supported)
    oldest = supported if oldest is None else oldest
    hint = f"; {remedy}" if remedy else ""
    if isinstance(version, bool) or not isinstance(version, int):
        raise error(
            f"{what} schema_version must be an integer such as {supported}, got {json.dumps(version)}{hint}"
        )
    if version > supported:
        raise error(
            f"{what} schema version {version} is newer than this fxpipe understands "
            f"({supported}); upgrade fxpipe" + (f", or {remedy}" if remedy else "")
        )
    if version < oldest:
        readable = (
            f"version {supported}" if oldest == supported else f"versions {oldest} to {supported}"
        )
        raise error(
            f"{what} schema version {version} is older than this fxpipe reads ({readable}){hint}"
        )
    return version


def refuse_unknown_fields(
    cls: type, data: dict[str, Any], what: str, error: type[FxpipeError]
) -> None:
    """Refuse keys of ``data`` that are not fields of the dataclass ``cls`` (missing ones take defaults)."""
    from dataclasses import fields

    known = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise error(f"unknown {what} {unknown}; expected some of {known}")
