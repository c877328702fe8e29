"""``load_pipeline``: every stage of a build directory chained in one process, called like the original model.

The stages come from ``fxpipe.codegen.load.load_stage`` (hash-checked, meta-device
construction); tied parameters are made one Parameter shared by the stages that use
them, so gradients equal the original model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.load import _set_tensor, _tie_weights, load_stage, read_manifest
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import BuildDirError

__all__ = ["Pipeline", "load_pipeline"]


class Pipeline(nn.Module):
    """All stages chained in one process, with the original model's forward signature.

    ``stages`` holds the stage modules; tied parameters are one Parameter object shared
    by the stages that use them, so gradients equal the original model's.
    """

    def __init__(self, manifest: Manifest, stages: list[nn.Module], build_dir: str | Path = ".") -> None:
        super().__init__()
        self.manifest = manifest
        self.stages = nn.ModuleList(stages)
        self._spec = _load_spec(manifest, Path(build_dir))

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


def _load_spec(manifest: Manifest, build_dir: Path) -> Any:
    if manifest.output_spec is None:
        return None
    from torch.utils._pytree import treespec_loads

    try:
        return treespec_loads(manifest.output_spec)
    except Exception:
        # container types (e.g. a Hugging Face ModelOutput) register with pytree when their library is imported,
        # which the model file does
        if manifest.model_file:
            from fxpipe.modelfile import import_model_module

            import_model_module(manifest.model_path(build_dir))
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
    stages = [load_stage(build_dir, i, device) for i in range(manifest.num_stages)]
    for tie in manifest.ties:
        shared = stages[tie.stages[0]].get_parameter(tie.keys[0])
        for s, key in zip(tie.stages[1:], tie.keys[1:]):
            _set_tensor(stages[s], key, shared)
            _tie_weights(stages[s])
    return Pipeline(manifest, stages, build_dir)
