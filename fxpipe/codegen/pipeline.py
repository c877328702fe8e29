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
from torch.utils._pytree import tree_unflatten

from fxpipe.codegen.load import _set_tensor, _tie_weights, load_stage, read_manifest
from fxpipe.codegen.manifest import Manifest
from fxpipe.codegen.outputs import load_output_spec

__all__ = ["Pipeline", "load_pipeline"]


class Pipeline(nn.Module):
    """All stages chained in one process, called like the original model.

    ``pipeline(*args, **kwargs)`` binds the call as the original forward would (Note [the
    traced call] in ``fxpipe.tracer.call``): tensors may be passed by position or by name,
    and an argument that was a constant of the trace must be left at that value (else a
    ``CallError``). The output has the model's own structure (Note [output structure] in
    ``fxpipe.codegen.outputs``). ``stages`` holds the stage modules; tied parameters are one
    Parameter object shared by the stages that use them, so gradients equal the original model's.
    """

    def __init__(self, manifest: Manifest, stages: list[nn.Module], build_dir: str | Path = ".") -> None:
        super().__init__()
        self.manifest = manifest
        self.stages = nn.ModuleList(stages)
        self.call = manifest.call_spec
        self._spec = load_output_spec(manifest, Path(build_dir))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        m = self.manifest
        inputs = self.call.bind(args, kwargs)
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
        return tree_unflatten(result, self._spec)


def load_pipeline(build_dir: str | Path, device: str | torch.device = "cpu") -> Pipeline:
    """All stages of ``build_dir`` on one device, chained: ``load_pipeline(d)(*args, **kwargs)`` is the model.

    Example::

        model = load_pipeline("build")
        logits = model(tokens)
        loss = load_pipeline("hf_build")(input_ids=ids, attention_mask=mask, labels=ids).loss
    """
    manifest = read_manifest(build_dir)
    stages = [load_stage(build_dir, i, device) for i in range(manifest.num_stages)]
    for tie in manifest.ties:
        shared = stages[tie.stages[0]].get_parameter(tie.keys[0])
        for s, key in zip(tie.stages[1:], tie.keys[1:]):
            _set_tensor(stages[s], key, shared)
            _tie_weights(stages[s])
    return Pipeline(manifest, stages, build_dir)
