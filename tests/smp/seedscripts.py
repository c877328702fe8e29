"""Load the seed example scripts (``examples/seed_scripts``) as modules, as ``import fxpipe as smp`` sees them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "seed_scripts"


def load_script(name: str) -> ModuleType:
    """Import ``examples/seed_scripts/<name>.py`` once per process."""
    key = f"seed_script_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
