"""Make the one spawn helper (tests/runtime), the data-parallel oracle (tests/runtime/dataparallel), the
seed API's scenarios (tests/smp) and the ported
FairScale scripts (examples/fairscale_scripts) importable from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _path in (
    _ROOT / "tests" / "runtime",
    _ROOT / "tests" / "runtime" / "dataparallel",
    _ROOT / "tests" / "smp",
    _ROOT / "examples" / "fairscale_scripts",
):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
