"""Make the runtime tests' helpers (the one spawn helper, real builds) importable from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

_RUNTIME_TESTS = str(Path(__file__).resolve().parent.parent / "runtime")
if _RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, _RUNTIME_TESTS)
