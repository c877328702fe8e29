"""The compiler's safety net: a build is swapped in only if its stages, chained, are the model.

Note [safety net]: ``write_build_dir`` (so ``fxpipe partition`` and the seed API's
first-step partitioning) loads the staged build with ``load_pipeline`` and runs it against
the model it was traced from, in the same process, on the example inputs it was traced
with: forward and backward, in train mode and in eval mode, from the same seed
(:func:`fxpipe.codegen.check.equivalence.compare_in_mode`). A mismatch refuses the build with one
line naming the first tensor that differs: the first stage output that is not the traced
graph's value at the same node (with the stage and the unit that made it), else the
traced graph itself (the trace missed something), else the gradient or buffer that is off.
It costs one more copy of the weights (the loaded stages), four forward and backward
passes at the traced microbatch, and one stage load (measured in docs/cli.md, "The safety net");
``--no-check`` / ``check=False`` skips it for models too large to hold twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from fxpipe.codegen.check.equivalence import (
    ModeComparison,
    Run,
    compare_in_mode,
    compare_tensor,
    mode_name,
    probe_loss,
    state_kept,
)
from fxpipe.codegen.load import forget_stage_modules
from fxpipe.codegen.pipeline import load_pipeline
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import EquivalenceError
from fxpipe.tracer.train_eval.modes import modes_restored, run_in_mode
from fxpipe.tracer.seeding import seeded
from fxpipe.tracer.traced import TracedModel

__all__ = ["check_equivalence"]

_SEED = 0
_SKIP = "the build was not written (--no-check / check=False writes it unchecked)"


def check_equivalence(
    build_dir: Path, manifest: Manifest, traced: TracedModel, sources: Mapping[str, str]
) -> None:
    """Refuse the build in ``build_dir`` unless its stages equal ``traced.model`` in both modes (Note [safety net]).

    ``sources`` maps each boundary tensor's name to the traced node that computes it
    (``SplitGraph.sources``). Raises :class:`EquivalenceError` with one line.
    """
    model = traced.model
    device = next(
        (t.device for t in list(model.parameters()) + list(model.buffers())), torch.device("cpu")
    )
    try:
        pipeline = load_pipeline(build_dir, device=device)
        for training in (True, False):
            result = compare_in_mode(
                model,
                pipeline,
                list(pipeline.stages),
                _example_call(traced),
                training=training,
                loss=probe_loss,
                seed=_SEED,
            )
            if not result.ok:
                raise EquivalenceError(_explain(result, traced, pipeline, manifest, sources))
    finally:
        forget_stage_modules(build_dir)


def _example_call(traced: TracedModel) -> Run:
    """Calls a model (the original, or the chained stages) the way it was traced."""
    inputs = traced.example_inputs
    if traced.call is None:
        return lambda model: model(*inputs)
    return traced.call.call_of(inputs)


def _explain(
    result: ModeComparison,
    traced: TracedModel,
    pipeline: nn.Module,
    manifest: Manifest,
    sources: Mapping[str, str],
) -> str:
    mode = mode_name(result.training)
    graph_values, stage_outputs = _values(traced, pipeline, result.training)
    for sm, outs in zip(manifest.stages, stage_outputs):
        for t, got in zip(sm.outputs, outs):
            node = sources.get(t.name)
            if node is None or node not in graph_values:
                continue
            err = compare_tensor(t.name, got, graph_values[node])
            if not err.ok:
                unit = traced.unit_of_node.get(node, "?")
                where = (
                    f"to stage {', '.join(map(str, t.consumers))}"
                    if t.consumers
                    else "a model output"
                )
                return (
                    f"the emitted stages differ from the model in {mode} mode: {t.name!r} (stage {sm.index}, "
                    f"{where}), made by unit {unit!r}, is off by {err.max_abs:.3g}; {_SKIP}"
                )
    worst = result.worst
    assert worst is not None
    if worst.name.startswith("output") and not _graph_matches_model(
        traced, graph_values, result.training
    ):
        return (
            f"the traced graph differs from the model in {mode} mode ({worst.name} off by {worst.max_abs:.3g}): "
            f"the trace did not capture what the model computes; {_SKIP}"
        )
    owner = _unit_of_tensor(traced, worst.name.split(" ", 1)[-1])
    if worst.name.startswith("requires_grad "):
        key = worst.name.split(" ", 1)[1]
        return (
            f"the emitted stages differ from the model: parameter {key!r} has another requires_grad than "
            f"in the model{f' (unit {owner!r})' if owner else ''}; {_SKIP}"
        )
    return (
        f"the emitted stages differ from the model in {mode} mode: {worst.name} is off by {worst.max_abs:.3g}"
        f"{f' (unit {owner!r})' if owner else ''}; {_SKIP}"
    )


def _values(
    traced: TracedModel, pipeline: nn.Module, training: bool
) -> tuple[dict[str, Any], list[Sequence[Any]]]:
    """The traced graph's value at every node and every stage's outputs, in one mode, from the check's seed
    (with autograd on, as in the comparison: without it, eval-mode attention layers take a fused fast path)."""
    model, inputs = traced.model, traced.example_inputs
    with state_kept(model), seeded(_SEED), torch.enable_grad():
        model.train(training)
        env = run_in_mode(traced.graph_module, inputs, training)
    captured: list[Sequence[Any]] = []
    hooks = [
        stage.register_forward_hook(lambda _m, _a, out: captured.append(tuple(out)))
        for stage in pipeline.stages  # type: ignore[union-attr]
    ]
    try:
        with modes_restored(pipeline), seeded(_SEED), torch.enable_grad():
            pipeline.train(training)
            _example_call(traced)(pipeline)
    finally:
        for hook in hooks:
            hook.remove()
    return {n.name: v for n, v in env.items()}, captured


def _graph_matches_model(
    traced: TracedModel, graph_values: Mapping[str, Any], training: bool
) -> bool:
    model = traced.model
    with state_kept(model), seeded(_SEED), torch.enable_grad():
        model.train(training)
        want = tree_leaves(_example_call(traced)(model))
    out = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
    got = [graph_values.get(n.name) for n in out.args[0]]
    return len(got) == len(want) and all(compare_tensor("", g, w).ok for g, w in zip(got, want))


def _unit_of_tensor(traced: TracedModel, key: str) -> str | None:
    """The unit that reads parameter ``key``, or that lives at the module owning buffer ``key``."""
    for u in traced.profile.units:
        if key in u.params:
            return u.name
    owner = key.rpartition(".")[0]
    return next((u.name for u in traced.profile.units if u.module_path == owner), None)
