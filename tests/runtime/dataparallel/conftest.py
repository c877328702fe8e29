"""Make the shared runtime test helpers (``spawn``, ``reference``) importable from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

_RUNTIME_TESTS = str(Path(__file__).resolve().parent.parent)
if _RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, _RUNTIME_TESTS)
