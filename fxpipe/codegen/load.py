"""Load stages from a build directory: one stage per rank, or all chained in one process.

Note [loading safely and lightly]: ``load_stage`` checks the sha256 of every file the
stage needs (its source and weights, and the model file when the stage imports classes
from it) against ``manifest.json`` before importing or reading any of them (Note [check
before use] in ``fxpipe.codegen.integrity``), and executes the very bytes it hashed
(never re-reading the file); the model file is imported from its checked bytes too. It
builds the module on the meta device and then loads the weights file with
``load_state_dict(assign=True)``, so no memory is spent on initial values and a rank's
peak is about its own stage's tensors.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.integrity import CheckedBuild, check_build, model_import_needed
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import BuildDirError

__all__ = ["load_stage", "load_pipeline", "Pipeline", "read_manifest", "load_checked_stage", "load_checked_pipeline"]


def read_manifest(build_dir: str | Path) -> Manifest:
    """The manifest of ``build_dir`` (BuildDirError if missing, malformed or of another schema)."""
    return Manifest.from_json(Path(build_dir))


def _stage_class(build: CheckedBuild, index: int) -> type[nn.Module]:
    sm = build.manifest.stage(index)
    checked = build.source(index)
    assert checked.data is not None
    if model_import_needed(build.manifest, [index]):  # classes from the model file: imported from its checked bytes
        build.model_module()
    name = f"fxpipe_stage_{sm.index}_{sm.source_sha256[:16]}"
    module = sys.modules.get(name)
    if module is None:
        path = checked.path
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        exec(compile(checked.data, str(path), "exec"), module.__dict__)  # noqa: S102 - hash-checked generated code
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
    manifest = read_manifest(build_dir)
    manifest.stage(index)
    build = check_build(build_dir, [index], model=model_import_needed(manifest, [index]), plan=False,
                        manifest=manifest)
    return load_checked_stage(build, index, device)


def load_checked_stage(build: CheckedBuild, index: int, device: str | torch.device = "cpu") -> nn.Module:
    """``load_stage`` on files ``check_build`` has checked (stage ``index``'s source and weights among them)."""
    sm = build.manifest.stage(index)
    cls = _stage_class(build, index)
    with torch.device("meta"):
        module = cls()
    tensors = build.load_weights(index, device)
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


class Pipeline(nn.Module):
    """All stages chained in one process, with the original model's forward signature.

    ``stages`` holds the stage modules; tied parameters are one Parameter object shared
    by the stages that use them, so gradients equal the original model's.
    """

    def __init__(self, manifest: Manifest, stages: list[nn.Module], build_dir: str | Path = ".",
                 build: CheckedBuild | None = None) -> None:
        super().__init__()
        self.manifest = manifest
        self.stages = nn.ModuleList(stages)
        self._spec = _load_spec(manifest, Path(build_dir), build)

    def forward(self, *inputs: torch.Tensor) -> Any:
        m = self.manifest
        if len(inputs) != len(m.inputs):
            raise TypeError(f"the model takes {len(m.inputs)} inputs ({', '.join(t.name for t in m.inputs)}), "
                            f"got {len(inputs)}")
        values: dict[tuple[int, str], Any] = {}
        for t, x in zip(m.inputs, inputs):
            values[(t.producer, t.name)] = x
        flat: dict[int, Any] = {}
        for sm, stage in zip(m.stages, self.stages):
            outs = stage(*(values[(t.producer, t.name)] for t in sm.inputs))
            for t, v in zip(sm.outputs, outs):
                values[(t.producer, t.name)] = v
                if t.model_output is not None:
                    flat[t.model_output] = v
        result = [flat[k] for k in range(len(flat))]
        if self._spec is None:
            return tuple(result)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(result, self._spec)


def _load_spec(manifest: Manifest, build_dir: Path, build: CheckedBuild | None) -> Any:
    if manifest.output_spec is None:
        return None
    from torch.utils._pytree import treespec_loads

    try:
        return treespec_loads(manifest.output_spec)
    except Exception:
        # container types (e.g. a Hugging Face ModelOutput) register with pytree when their library is imported,
        # which the model file does: imported from its checked bytes
        if manifest.model_file:
            if build is None or build.model is None:
                build = check_build(build_dir, [], plan=False, weights=False, manifest=manifest)
            build.model_module()
        try:
            return treespec_loads(manifest.output_spec)
        except Exception as exc:
            raise BuildDirError(f"cannot rebuild the model's output structure from manifest.json: {exc}") from exc


def load_pipeline(build_dir: str | Path, device: str | torch.device = "cpu") -> Pipeline:
    """All stages of ``build_dir`` on one device, chained: ``load_pipeline(d)(*inputs)`` is the model.

    Example::

        model = load_pipeline("build")
        logits = model(tokens)
    """
    manifest = read_manifest(build_dir)
    build = check_build(build_dir, plan=False, model=model_import_needed(manifest, range(manifest.num_stages)),
                        manifest=manifest)
    return load_checked_pipeline(build, device)


def load_checked_pipeline(build: CheckedBuild, device: str | torch.device = "cpu") -> Pipeline:
    """``load_pipeline`` on files ``check_build`` has checked (every stage's)."""
    manifest = build.manifest
    stages = [load_checked_stage(build, i, device) for i in range(manifest.num_stages)]
    for tie in manifest.ties:
        shared = stages[tie.stages[0]].get_parameter(tie.keys[0])
        for s, key in zip(tie.stages[1:], tie.keys[1:]):
            _set_tensor(stages[s], key, shared)
            _tie_weights(stages[s])
    return Pipeline(manifest, stages, build.build_dir, build)
