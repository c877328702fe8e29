"""The classes several stages of a build share (``shared.py``), and how a stage imports them.

Note [classes several stages share]: a build names its generated classes once for all its
stages (one text, one name: Note [one class per distinct body] in :mod:`fxpipe.codegen.render.classes`),
and a class that more than one stage uses is written once, into ``shared.py`` beside the stage
files, not again in each. The manifest hashes it like a stage file (``shared_sha256``) and says
which stages import it (``imports_shared``); ``check_build`` checks it, before any of it runs,
whenever a stage it checks imports it, so a tampered ``shared.py`` is refused as a tampered stage
file is. A stage file reads ``_shared = import_shared(__file__)``:

- under ``load_stage`` (and everything built on it), the loader has imported the checked bytes
  and the call returns that module (``loading``), never reading the file again;
- a stage file imported some other way checks ``shared.py`` against the ``manifest.json`` beside
  it before running it.

``shared.py`` holds classes only (no tensors), so ``load_stage`` still builds one stage alone.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from fxpipe.codegen.integrity import CheckedBuild, CheckedFile, check_shared
from fxpipe.errors import BuildDirError

__all__ = ["SHARED_SOURCE", "import_shared", "load_shared", "shared_module", "loading"]

SHARED_SOURCE = "shared.py"
_LOADING: dict[
    str, ModuleType
] = {}  # folder of the stage files being loaded -> its build's shared module


def load_shared(checked: CheckedFile) -> ModuleType:
    """The shared classes run from ``checked``'s bytes (once per content: the module is named by its hash)."""
    assert checked.data is not None
    name = f"fxpipe_shared_{checked.sha256[:16]}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(checked.path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(checked.path)
    sys.modules[name] = module
    try:
        exec(compile(checked.data, str(checked.path), "exec"), module.__dict__)  # noqa: S102 - hash-checked
    except Exception as exc:
        del sys.modules[name]
        raise BuildDirError(
            f"{checked.path.name} failed to run: {type(exc).__name__}: {exc}; rebuild the "
            "directory with `fxpipe partition`"
        ) from exc
    return module


def shared_module(build: CheckedBuild) -> ModuleType:
    """``build``'s shared classes run from their checked bytes."""
    if build.shared is None:
        raise BuildDirError(f"{build.build_dir}: the shared classes were not checked")
    return load_shared(build.shared)


@contextmanager
def loading(folder: str | Path, module: ModuleType) -> Iterator[None]:
    """While a stage file of ``folder`` runs, ``import_shared`` gives it ``module`` (checked already)."""
    key = str(Path(folder))
    previous = _LOADING.get(key)
    _LOADING[key] = module
    try:
        yield
    finally:
        if previous is None:
            _LOADING.pop(key, None)
        else:
            _LOADING[key] = previous


def import_shared(stage_file: str) -> ModuleType:
    """The shared classes of the build the stage file ``stage_file`` belongs to (Note [classes several stages
    share]): the module ``load_stage`` checked, or ``shared.py`` checked now against ``manifest.json``."""
    folder = Path(stage_file).parent
    module = _LOADING.get(str(folder))
    if module is not None:
        return module
    return load_shared(check_shared(folder))
