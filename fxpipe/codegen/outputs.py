"""The model's output structure in a build: its pytree spec and the modules that register its containers.

Note [output structure]: stages return flat tuples of tensors; whoever needs the model's
own output (``load_pipeline``, the last stage's loss under ``fxpipe run`` and
``PipelineRunner``, the seed API's ``model(...)``) rebuilds it from the spec stored in
``manifest.json``. A container that its library registers with pytree (a transformers
``ModelOutput`` subclass registers when ``transformers.modeling_outputs`` is imported)
cannot be read back in a process that has not imported that library yet, so the manifest
lists the modules that define the containers (``output_modules``) and ``load_output_spec``
imports them first. A container defined in the model file itself is registered by importing
the model file, which ``load_output_spec`` does when it is given the build directory.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.utils._pytree as pytree

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import BuildDirError

if TYPE_CHECKING:
    from fxpipe.codegen.integrity import CheckedBuild

__all__ = ["dump_output_spec", "load_output_spec", "rebuild_output"]

_BUILTIN_MODULES = ("builtins", "collections", "torch")


def _container_modules(spec: pytree.TreeSpec) -> list[str]:
    """The modules defining the container types of ``spec`` that pytree does not know by itself."""
    found: list[str] = []
    if spec.type is not None:
        module = spec.type.__module__
        if module.split(".")[0] not in _BUILTIN_MODULES and not module.startswith("fxpipe_model_"):
            found.append(module)
    for child in spec.children():
        found += _container_modules(child)
    return found


def dump_output_spec(spec: pytree.TreeSpec | None) -> tuple[str | None, tuple[str, ...]]:
    """``(spec as JSON, modules to import before reading it)``; ``(None, ())`` when pytree cannot
    serialize the spec (warned: the build then returns a flat tuple of tensors)."""
    if spec is None:
        return None, ()
    try:
        text = pytree.treespec_dumps(spec)
    except Exception as exc:  # noqa: BLE001 - a container type pytree cannot serialize
        warnings.warn(
            f"cannot serialize the model's output structure ({exc}); the build will return a flat "
            "tuple of tensors",
            stacklevel=4,
        )
        return None, ()
    return text, tuple(dict.fromkeys(_container_modules(spec)))


@functools.lru_cache(maxsize=16)
def _loads(text: str, modules: tuple[str, ...]) -> pytree.TreeSpec:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise BuildDirError(
                f"the model's output is a container from {name!r}, which cannot be imported here "
                f"({exc}); install it where the build runs"
            ) from exc
    return pytree.treespec_loads(text)


def load_output_spec(
    manifest: Manifest, build_dir: str | Path | None = None, build: CheckedBuild | None = None
) -> pytree.TreeSpec | None:
    """The manifest's output spec (``None``: the build returns a flat tuple), after importing the
    modules that register its containers (see the Note); with ``build_dir`` (or an already
    checked ``build``), the model file too when that is still needed, imported from its checked
    bytes (Note [check before use] in ``fxpipe.codegen.integrity``)."""
    if manifest.output_spec is None:
        return None
    try:
        return _loads(manifest.output_spec, manifest.output_modules)
    except BuildDirError:
        raise
    except Exception as first:  # noqa: BLE001 - a container registered by the model file itself
        if (build is None and build_dir is None) or not manifest.model_file:
            raise BuildDirError(
                f"cannot rebuild the model's output structure from manifest.json: {first}; import "
                "the module that defines its container type first"
            ) from first
        if build is None or build.model is None:
            from fxpipe.codegen.integrity import check_build

            where = build_dir if build_dir is not None else build.build_dir  # type: ignore[union-attr]
            build = check_build(where, [], plan=False, weights=False, manifest=manifest)
        build.model_module()
        try:
            return _loads(manifest.output_spec, manifest.output_modules)
        except Exception as exc:  # noqa: BLE001 - reported with the build's context
            raise BuildDirError(
                f"cannot rebuild the model's output structure from manifest.json: {exc}"
            ) from exc


def rebuild_output(manifest: Manifest, flat: list[Any], build_dir: str | Path | None = None) -> Any:
    """The model's output from its flattened outputs: its own structure, else the one tensor or a tuple."""
    spec = load_output_spec(manifest, build_dir)
    if spec is not None:
        return pytree.tree_unflatten(list(flat), spec)
    return flat[0] if len(flat) == 1 else tuple(flat)
