"""Load one stage of a build directory (``load_stage``); ``fxpipe.codegen.pipeline`` chains them all.

Note [loading safely and lightly]: ``load_stage`` checks the sha256 of every file the
stage needs (its source and weights, the build's shared classes when it imports them, and the
model file when the stage imports classes from it) against ``manifest.json`` before importing or reading any of them (Note [check
before use] in ``fxpipe.codegen.integrity``), and executes the very bytes it hashed
(never re-reading the file); the model file is imported from its checked bytes too. It
builds the module on the meta device and then loads the weights file with
``load_state_dict(assign=True)``, so no memory is spent on initial values and a rank's
peak is about its own stage's tensors. A meta build without a checkpoint wrote no parameters:
the stage initialises them itself (Note [each stage initialises itself] in
``fxpipe.codegen.stage_init``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.integrity import CheckedBuild, check_build, model_import_needed
from fxpipe.codegen.manifest import Manifest
from fxpipe.codegen.shared import loading, shared_module
from fxpipe.codegen.stage_init import initialise_stage
from fxpipe.errors import BuildDirError
from fxpipe.modelfile import checked_model_import

__all__ = ["load_stage", "load_checked_stage", "read_manifest"]


def read_manifest(build_dir: str | Path) -> Manifest:
    """The manifest of ``build_dir`` (BuildDirError if missing, malformed or of another schema)."""
    return Manifest.from_json(Path(build_dir))


def _stage_class(build: CheckedBuild, index: int) -> type[nn.Module]:
    sm = build.manifest.stage(index)
    checked = build.source(index)
    assert checked.data is not None
    name = f"fxpipe_stage_{sm.index}_{sm.source_sha256[:16]}"
    model = None
    if model_import_needed(
        build.manifest, [index]
    ):  # classes from the model file: imported from its checked bytes
        model = build.model_module()
        # the same stage source over another model file holds other classes (Note [what is hashed is what runs])
        name += f"_{build.manifest.model_sha256[:16]}"
    shared = (
        shared_module(build) if sm.imports_shared else None
    )  # Note [classes several stages share]
    if shared is not None and build.shared is not None:
        name += f"_{build.shared.sha256[:16]}"
    module = sys.modules.get(name)
    if module is None:
        path = checked.path
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        with contextlib.ExitStack() as imports:
            if model is not None:
                imports.enter_context(checked_model_import(model))
            if shared is not None:
                imports.enter_context(loading(path.parent, shared))
            exec(compile(checked.data, str(path), "exec"), module.__dict__)  # noqa: S102 - hash-checked code
        sys.modules[name] = module
    cls = getattr(module, sm.class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise BuildDirError(
            f"{sm.source} defines no nn.Module class {sm.class_name!r}; the build directory is broken"
        )
    return cls


def _set_tensor(module: nn.Module, key: str, value: torch.Tensor) -> None:
    owner_path, _, name = key.rpartition(".")
    owner = module.get_submodule(owner_path)
    if isinstance(value, nn.Parameter) or name in owner._parameters:
        owner.register_parameter(
            name, value if isinstance(value, nn.Parameter) else nn.Parameter(value)
        )
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
    manifest = read_manifest(build_dir)
    manifest.stage(index)
    build = check_build(
        build_dir,
        [index],
        model=model_import_needed(manifest, [index]),
        plan=False,
        manifest=manifest,
    )
    return load_checked_stage(build, index, device)


def load_checked_stage(
    build: CheckedBuild, index: int, device: str | torch.device = "cpu"
) -> nn.Module:
    """``load_stage`` on files ``check_build`` has checked (stage ``index``'s source and weights among them)."""
    sm = build.manifest.stage(index)
    cls = _stage_class(build, index)
    with torch.device("meta"):
        module = cls()
    tensors = build.load_weights(index, device)
    persistent = set(module.state_dict(keep_vars=True))
    result = module.load_state_dict(
        {k: v for k, v in tensors.items() if k in persistent}, strict=False, assign=True
    )
    for key in set(tensors) - persistent:
        _set_tensor(module, key, tensors[key])
    _tie_weights(module)
    if (
        build.manifest.weights == "init"
    ):  # a meta build without --weights (Note [each stage initialises itself])
        initialise_stage(
            module,
            index,
            build.manifest.ties,
            device=device,
            init_models=build.manifest.init_models,
        )
    if result.unexpected_keys:
        raise BuildDirError(
            f"{sm.weights} holds keys {result.unexpected_keys[:5]} that {sm.class_name} does not have"
        )
    left = [
        k
        for k, t in list(module.named_parameters(remove_duplicate=False))
        + list(module.named_buffers(remove_duplicate=False))
        if t.is_meta
    ]
    if left:
        raise BuildDirError(
            f"{sm.weights} has no values for {left[:5]} of stage {index}; rebuild the directory"
        )
    return module


def forget_stage_modules(build_dir: str | Path) -> None:
    """Drop the modules imported from the files under ``build_dir`` (stages, ``shared.py``): a
    staging folder is renamed when swapped in, and a later ``load_pipeline`` of the build must
    import them from where they then are."""
    prefix = str(Path(build_dir).absolute()) + os.sep
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(prefix):
            del sys.modules[name]
