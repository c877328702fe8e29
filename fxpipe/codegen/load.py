"""Load one stage of a build directory (``load_stage``); ``fxpipe.codegen.pipeline`` chains them all.

Note [loading safely and lightly]: ``load_stage`` checks the sha256 of the stage's
source and weights against ``manifest.json`` before importing anything, and executes
the very bytes it hashed (never re-reading the file). It builds the module on the
meta device and then loads the weights file with ``load_state_dict(assign=True)``,
so no memory is spent on initial values and a rank's peak is about its own stage's
tensors. (The weights file is hashed, then read; a file swapped in between is not
caught, which is acceptable for files the user controls.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import Manifest, StageManifest
from fxpipe.errors import BuildDirError
from fxpipe.modelfile import file_sha256

__all__ = ["load_stage", "read_manifest"]


def read_manifest(build_dir: str | Path) -> Manifest:
    """The manifest of ``build_dir`` (BuildDirError if missing, malformed or of another schema)."""
    return Manifest.from_json(Path(build_dir))


def _checked_bytes(path: Path, expected: str, what: str) -> bytes:
    """The file's bytes, refused unless their sha256 is the manifest's (the bytes that were
    checked are the bytes used, so the file cannot change in between)."""
    if not path.is_file():
        raise BuildDirError(f"{what} {str(path)!r} is missing; rebuild the directory with `fxpipe partition`")
    data = path.read_bytes()
    _require_hash(path, hashlib.sha256(data).hexdigest(), expected, what)
    return data


def _check_file(path: Path, expected: str, what: str) -> None:
    """Refuse a file whose sha256 is not the manifest's (hashed as a stream: weights are large)."""
    if not path.is_file():
        raise BuildDirError(f"{what} {str(path)!r} is missing; rebuild the directory with `fxpipe partition`")
    _require_hash(path, file_sha256(path), expected, what)


def _require_hash(path: Path, actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise BuildDirError(f"{what} {path.name} has sha256 {actual[:12]}…, but manifest.json expects "
                            f"{expected[:12]}…: the file changed after it was built; rebuild with `fxpipe partition`")


def _stage_class(build_dir: Path, manifest: Manifest, sm: StageManifest) -> type[nn.Module]:
    path = build_dir / sm.source
    code = _checked_bytes(path, sm.source_sha256, "stage source")
    _check_file(build_dir / sm.weights, sm.weights_sha256, "stage weights")
    if sm.imports_model_file and manifest.model_sha256:  # the stage runs classes from the model file
        _check_file(manifest.model_path(build_dir), manifest.model_sha256, "model file")
    name = f"fxpipe_stage_{sm.index}_{sm.source_sha256[:16]}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        exec(compile(code, str(path), "exec"), module.__dict__)  # noqa: S102 - hash-checked generated code
        sys.modules[name] = module
    cls = getattr(module, sm.class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise BuildDirError(f"{sm.source} defines no nn.Module class {sm.class_name!r}; the build directory is broken")
    return cls


def _set_tensor(module: nn.Module, key: str, value: torch.Tensor) -> None:
    owner_path, _, name = key.rpartition(".")
    owner = module.get_submodule(owner_path)
    if isinstance(value, nn.Parameter) or name in owner._parameters:
        owner.register_parameter(name, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        owner._buffers[name] = value


def _tie_weights(module: nn.Module) -> None:
    """Re-tie shared weights inside an emitted stage that defines ``tie_weights()``."""
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()


def load_stage(build_dir: str | Path, index: int, device: str | torch.device = "cpu") -> nn.Module:
    """Build stage ``index`` of ``build_dir`` on ``device`` with its weights, and nothing else.

    See Note [loading safely and lightly]. Raises BuildDirError for a missing or
    tampered file, an unknown manifest schema or an index out of range.

    Example::

        stage = load_stage("build", 1, device="cuda:1")
        outputs = stage(*inputs)   # inputs in manifest.stages[1].inputs order
    """
    from safetensors.torch import load_file

    build_dir = Path(build_dir)
    manifest = read_manifest(build_dir)
    sm = manifest.stage(index)
    cls = _stage_class(build_dir, manifest, sm)
    with torch.device("meta"):
        module = cls()
    tensors = load_file(str(build_dir / sm.weights), device=str(device))
    persistent = set(module.state_dict(keep_vars=True))
    result = module.load_state_dict({k: v for k, v in tensors.items() if k in persistent}, strict=False, assign=True)
    for key in set(tensors) - persistent:
        _set_tensor(module, key, tensors[key])
    _tie_weights(module)
    if result.unexpected_keys:
        raise BuildDirError(f"{sm.weights} holds keys {result.unexpected_keys[:5]} that {sm.class_name} does not have")
    left = [k for k, t in list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)) if t.is_meta]
    if left:
        raise BuildDirError(f"{sm.weights} has no values for {left[:5]} of stage {index}; rebuild the directory")
    return module
