"""Chained stages vs the original model in one mode, with the zoo's own inputs (positional or keyword) and loss.

A thin adaptor over :func:`fxpipe.codegen.check.equivalence.compare_in_mode` (the comparison ``fxpipe
verify`` and the safety net use), for the probe and the benchmark: the original model is rebuilt
with ``build_model()`` and given the build's weights, both it and ``fxpipe.load_pipeline(build_dir)``
run the model file's inputs function (``source.inputs_fn``: a tuple, or a dict of keyword inputs)
at the build's batch size from the same seed in one mode, then the model's own ``output.loss``
when the inputs hold ``labels=`` or ``return_loss=True``, else ``loss_fn(output,
example_targets)``, and backward. Every output leaf, every parameter gradient and every buffer
afterwards is compared, fp32.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from fxpipe.codegen.check.equivalence import ATOL, RTOL, compare_in_mode

__all__ = [
    "Comparison",
    "CompiledComparison",
    "reference_model",
    "compare_pipeline",
    "compare_modes",
    "compare_compiled",
    "RTOL",
    "ATOL",
]


@dataclass(frozen=True)
class Comparison:
    """How far the pipeline is from the original in one mode: ``max_abs`` over all compared tensors,
    ``worst`` the tensor furthest outside the tolerance (or the largest error when all are inside)."""

    training: bool
    ok: bool
    max_abs: float
    worst: str
    outputs: int
    grads: int
    buffers: int
    failing: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reference_model(build_dir: Path, source: Any) -> nn.Module:
    """``source.build_model()`` with every tensor of the build's stage weights files copied in by name."""
    from safetensors.torch import load_file

    model = source.build_model()
    named: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    manifest = json.loads((build_dir / "manifest.json").read_text())
    with torch.no_grad():
        for stage in manifest["stages"]:
            for key, value in load_file(str(build_dir / stage["weights"])).items():
                if key in named and named[key].shape == value.shape:
                    named[key].copy_(value)
    return model


def _call(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)``; a dict is keyword inputs, an ``(args, kwargs)`` pair both."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return model(*inputs[0], **inputs[1])
    return model(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))


def compare_pipeline(
    build_dir: str | Path,
    source: Any,
    training: bool,
    prepare: Callable[[nn.Module], None] | None = None,
) -> Comparison:
    """Compare ``load_pipeline(build_dir)`` with the original model in train (``training``) or eval mode;
    ``prepare(stage)`` runs on each loaded stage first (``torch.compile`` it, say)."""
    return compare_modes(build_dir, source, (training,), prepare)[0]


def compare_modes(
    build_dir: str | Path,
    source: Any,
    modes: tuple[bool, ...],
    prepare: Callable[[nn.Module], None] | None = None,
) -> list[Comparison]:
    """``compare_pipeline`` in each mode of ``modes`` (``True``: train), one after the other on the
    same loaded (and prepared) stages."""
    import fxpipe

    build_dir = Path(build_dir)
    manifest = json.loads((build_dir / "manifest.json").read_text())
    batch = int(manifest["batch_size"])
    if manifest.get("static_batch"):  # a batch the model fixes: one microbatch (CLIP's B x B loss)
        batch = int(manifest["microbatch_size"])
    reference = reference_model(build_dir, source)
    pipeline = fxpipe.load_pipeline(build_dir)
    for stage in pipeline.stages if prepare is not None else ():
        prepare(stage)
    inputs = getattr(source.module, source.inputs_fn)(batch)
    if isinstance(inputs, dict) and ("labels" in inputs or inputs.get("return_loss") is True):

        def loss(output: Any) -> torch.Tensor:
            return output["loss"]
    else:
        targets = source.example_targets(batch)

        def loss(output: Any) -> torch.Tensor:
            return source.loss_fn(output, targets)

    results = [
        compare_in_mode(
            reference,
            pipeline,
            list(pipeline.stages),
            lambda m: _call(m, inputs),
            training=training,
            loss=loss,
        )
        for training in modes
    ]
    return [
        Comparison(
            training=training,
            ok=result.ok,
            max_abs=max((e.max_abs for e in result.rows), default=0.0),
            worst=result.worst.name if result.worst else "",
            outputs=len(result.outputs),
            grads=len(result.grads),
            buffers=len(result.buffers),
            failing=len(result.failing),
        )
        for training, result in zip(modes, results)
    ]


@dataclass(frozen=True)
class CompiledComparison:
    """``compare_compiled``'s result: the comparison, the graph breaks the stages reported, whether
    the backward's halves ran, and the halves that failed to compile (their regions one graph)."""

    comparison: Comparison
    breaks: list[str]
    halves_ran: bool
    split_failures: list[str]
    eval: Comparison | None = None  # then in eval mode, on the same compiled stages


def compare_compiled(build_dir: str | Path, source: Any, eval: bool = False) -> CompiledComparison:
    """``compare_pipeline`` in train mode (then, with ``eval``, in eval mode on the same stages) with
    every stage compiled as a zero-bubble run compiles it (``compile_module``, the backward cut
    into an input and a weight half), dropout drawing eager's random numbers
    (``torch._inductor.config.fallback_random``), Dynamo's caches reset first."""
    from fxpipe.runtime.pipeline.compiled import CompiledStage, compile_module
    from fxpipe.runtime.pipeline.compiled_split import split_failures, stats

    reports: list[CompiledStage] = []

    def compiled(stage: nn.Module) -> None:
        reports.append(compile_module(stage, "stage", split_backward=True, split_graphs=True))

    torch._dynamo.reset()
    failed, halves = len(split_failures), stats["input_half"]
    with torch._inductor.config.patch(fallback_random=True):
        results = compare_modes(build_dir, source, (True, False) if eval else (True,), compiled)
    return CompiledComparison(
        results[0],
        [b for r in reports for b in r.graph_breaks],
        stats["input_half"] > halves,
        split_failures[failed:],
        results[1] if eval else None,
    )
