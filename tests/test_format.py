"""The code is formatted by the one formatter configured in pyproject.toml (``[tool.ruff]``).

``ruff format`` rewrites a file the way it would be checked here; ``make format`` runs it on the
whole tree. The emitted stage files under ``tests/codegen/golden`` are left as codegen writes them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_formatted() -> None:
    pytest.importorskip("ruff")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--quiet", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, (
        f"run `make format` (ruff format):\n{result.stdout}{result.stderr}"
    )
