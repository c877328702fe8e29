"""One error for FairScale arguments that torch has no counterpart for (never silently ignored)."""

from __future__ import annotations

from typing import Any

from fxpipe.errors import ConfigError

__all__ = ["refuse_unsupported"]


def refuse_unsupported(api: str, given: dict[str, tuple[Any, Any]], remedy: str = "") -> None:
    """Raise naming every argument of ``given`` (``name -> (value, the only value torch can honour)``)
    whose value differs from what torch's machinery does."""
    bad = {k: v for k, (v, ok) in given.items() if v != ok}
    if bad:
        shown = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        raise ConfigError(
            f"{api}: {shown} {'has' if len(bad) == 1 else 'have'} no counterpart in torch's "
            f"machinery that fxpipe.sharding builds on; leave {'it' if len(bad) == 1 else 'them'} "
            f"at the default{'' if not remedy else '; ' + remedy}"
        )
