"""``load_pipeline``: every stage of a build directory chained in one process, called like the original model.

Every file the stages need is checked against the manifest first (Note [check before
use] in ``fxpipe.codegen.integrity``); the stages are built as ``load_stage`` builds them
(meta-device construction); tied parameters are made one Parameter shared by the stages that use
them, so gradients equal the original model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_unflatten

from fxpipe.codegen.integrity import CheckedBuild, check_build, model_import_needed
from fxpipe.codegen.load import _set_tensor, _tie_weights, load_checked_stage, read_manifest
from fxpipe.codegen.manifest import INPUT, BoundaryTensor, Manifest, StageManifest
from fxpipe.codegen.outputs import load_output_spec

__all__ = ["Pipeline", "load_pipeline", "load_checked_pipeline"]


class Pipeline(nn.Module):
    """All stages chained in one process, called like the original model.

    ``pipeline(*args, **kwargs)`` binds the call as the original forward would (Note [the
    traced call] in ``fxpipe.tracer.call``): tensors may be passed by position or by name,
    and an argument that was a constant of the trace must be left at that value (else a
    ``CallError``). The output has the model's own structure (Note [output structure] in
    ``fxpipe.codegen.outputs``). ``stages`` holds the stage modules; tied parameters are one
    Parameter object shared by the stages that use them, so gradients equal the original model's.
    Tensors pass between stages as in a distributed run: each stage holds its own copy of each tensor it
    receives (``_wire``), and the model outputs are the last stage's, as the runtime's loss sees them, so
    ``verify`` checks what a distributed run computes, gradients summed where the runtime sums them.
    """

    def __init__(
        self,
        manifest: Manifest,
        stages: list[nn.Module],
        build_dir: str | Path = ".",
        build: CheckedBuild | None = None,
    ) -> None:
        super().__init__()
        self.manifest = manifest
        self.stages = nn.ModuleList(stages)
        self.call = manifest.call_spec
        self._spec = load_output_spec(manifest, Path(build_dir), build)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        m = self.manifest
        inputs = self.call.bind(args, kwargs)
        if m.static_batch:  # Note [a batch the model fixes]
            sizes = [
                x.shape[t.batch_dim] for t, x in zip(m.inputs, inputs) if t.batch_dim is not None
            ]
            if sizes:
                m.check_static_batch(sizes[0])
        # a size outside the range the build was traced for is refused before any stage runs
        m.step_sizes([tuple(x.shape) for x in inputs], "load_pipeline's call")
        values: dict[tuple[int, str], Any] = {}  # each tensor as its producer made it
        for t, x in zip(m.inputs, inputs):
            values[(t.producer, t.name)] = x
        held: dict[
            tuple[int, str, int], Any
        ] = {}  # a stage's own copy of what it receives (once per tensor)

        def given(t: BoundaryTensor, sm: StageManifest) -> Any:
            key = (t.producer, t.name, sm.index)
            if key not in held:
                held[key] = _wire(values[(t.producer, t.name)], t, sm)
            return held[key]

        for sm, stage in zip(m.stages, self.stages):
            outs = stage(*(given(t, sm) for t in sm.inputs))
            for t, v in zip(sm.outputs, outs):
                values[(t.producer, t.name)] = v
        last = m.stages[-1]  # the runtime's loss runs there, on the model outputs it holds
        flat = {
            t.model_output: values[(t.producer, t.name)] if sm is last else given(t, last)
            for sm in m.stages
            for t in sm.outputs
            if t.model_output is not None
        }
        result = [flat[k] for k in range(len(flat))]
        if self._spec is None:
            return tuple(result)
        return tree_unflatten(result, self._spec)


def _wire(value: Any, t: BoundaryTensor, stage: StageManifest) -> Any:
    """What ``stage`` gets for ``t``, as the runtime gives it: a tensor from another stage is a copy of its
    own (it crossed a wire, or a detached hand-over on one rank), taken when its producer's forward ended;
    a model input is the caller's, copied only for a stage that changes it in place (Note [in-place ops
    across stages] in :mod:`fxpipe.tracer.frontend.mutation`)."""
    if isinstance(value, torch.Tensor) and (t.producer != INPUT or t.name in stage.mutated_inputs):
        return value.clone()  # in the producer's layout: a dropout mask is drawn in memory order
    return value


def load_pipeline(build_dir: str | Path, device: str | torch.device = "cpu") -> Pipeline:
    """All stages of ``build_dir`` on one device, chained: ``load_pipeline(d)(*args, **kwargs)`` is the model.

    Example::

        model = load_pipeline("build")
        logits = model(tokens)
        loss = load_pipeline("hf_build")(input_ids=ids, attention_mask=mask, labels=ids).loss
    """
    manifest = read_manifest(build_dir)
    build = check_build(
        build_dir,
        plan=False,
        model=model_import_needed(manifest, range(manifest.num_stages)),
        manifest=manifest,
    )
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
