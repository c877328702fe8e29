"""Reading and writing the JSON artifacts (profile, plan, manifest) in one way.

Each artifact carries a ``schema_version``; a newer one than this fxpipe knows is
refused with a message that says to upgrade, never half-read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fxpipe.errors import FxpipeError

__all__ = ["dump_json", "load_json", "check_schema_version"]


def dump_json(data: dict[str, Any], path: str | Path | None = None) -> str:
    """``data`` as indented JSON text, also written to ``path`` when given."""
    text = json.dumps(data, indent=1)
    if path is not None:
        Path(path).write_text(text + "\n")
    return text


def load_json(source: str | Path, what: str, error: type[FxpipeError]) -> dict[str, Any]:
    """Parse a JSON object from a path or from JSON text; ``what`` names it in errors."""
    text = str(source)
    if not text.lstrip().startswith("{"):
        path = Path(source)
        if not path.is_file():
            raise error(f"{what} file {str(path)!r} does not exist")
        text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def check_schema_version(data: dict[str, Any], supported: int, what: str, error: type[FxpipeError]) -> None:
    """Refuse an artifact written by a newer fxpipe."""
    version = data.get("schema_version", supported)
    if not isinstance(version, int) or version > supported:
        raise error(f"{what} schema version {version!r} is newer than this fxpipe understands "
                    f"({supported}); upgrade fxpipe")
