"""Chained stages vs the original model, in train mode or in eval mode, outputs + gradients + buffers.

This is the zoo's own check, independent of ``fxpipe verify`` (which uses fxpipe's own comparison):
the original model is rebuilt with ``build_model()`` and given the build's weights, both it and
``fxpipe.load_pipeline(build_dir)`` are put in the same mode (``.train()`` or ``.eval()``), and
both run the model file's ``example_inputs`` at the build's batch size from the same RNG seed,
then ``loss_fn(output, example_targets)`` and backward. Every output leaf, every parameter
gradient (tied parameters found through any of their names) and every buffer afterwards
(BatchNorm running statistics move in train mode) is compared, fp32.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = ["Comparison", "reference_model", "compare_pipeline", "RTOL", "ATOL"]

RTOL = 1e-4
ATOL = 1e-5


@dataclass(frozen=True)
class Comparison:
    """How far the pipeline is from the original in one mode.

    ``max_abs`` is over all compared tensors; ``worst`` names the tensor furthest outside the
    tolerance (or with the largest error when all are inside); ``structure`` says whether the
    pipeline returned the original's output structure ("same") or only its leaves ("leaves").
    """

    training: bool
    ok: bool
    max_abs: float
    worst: str
    structure: str
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


def _diff(got: Any, want: Any) -> tuple[float, bool]:
    """(max abs error, within tolerance) of two leaves; NaNs count as equal only where both are NaN."""
    if got is None or want is None:  # a gradient one side lacks counts as zeros
        other = want if got is None else got
        ok = other is None or (isinstance(other, torch.Tensor) and not bool(other.any()))
        return (0.0, True) if ok else (math.inf, False)
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):  # non-tensor output leaves
        try:
            equal = bool(got == want)
        except Exception:
            equal = False
        return (0.0 if equal else math.inf), equal
    if got.shape != want.shape:
        return math.inf, False
    if not want.is_floating_point():
        equal = bool(torch.equal(got.cpu(), want.cpu()))
        return (0.0 if equal else math.inf), equal
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    both_nan = torch.isnan(g) & torch.isnan(w)
    diff = torch.where(both_nan, torch.zeros_like(g), (g - w).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    if diff.numel() == 0:
        return 0.0, True
    ok = bool(torch.all(diff <= ATOL + RTOL * w.abs().nan_to_num(0.0)))
    return float(diff.max()), ok


def _call(model: nn.Module, inputs: Any) -> Any:
    """``model(*inputs)``; a dict is keyword inputs and an ``(args, kwargs)`` pair both (the future contract)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return model(*inputs[0], **inputs[1])
    return model(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))


def _loss(output: Any, source: Any, batch: int, inputs: Any) -> torch.Tensor:
    """The model's own loss when it was given ``labels=``, else the model file's ``loss_fn`` on its targets."""
    if isinstance(inputs, dict) and "labels" in inputs:
        return output["loss"]
    return source.loss_fn(output, source.example_targets(batch))


def _forward_backward(model: nn.Module, source: Any, batch: int,
                      restructure: Callable[[Any], Any] | None = None) -> tuple[Any, str]:
    """Seeded forward, the loss and backward; returns the output and how its structure was used.

    The inputs come from the model file's inputs function called directly (not through
    fxpipe's checks), so keyword inputs can be compared once fxpipe accepts them.
    """
    inputs = getattr(source.module, source.inputs_fn)(batch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        output = _call(model, inputs)
    structure = "same"
    try:
        loss = _loss(output, source, batch, inputs)
    except Exception:
        if restructure is None:
            raise
        output, structure = restructure(output), "leaves"
        loss = _loss(output, source, batch, inputs)
    loss.backward()
    return output, structure


def compare_pipeline(build_dir: str | Path, source: Any, training: bool) -> Comparison:
    """Compare ``load_pipeline(build_dir)`` with the original model in train (``training``) or eval mode."""
    import fxpipe

    build_dir = Path(build_dir)
    batch = int(json.loads((build_dir / "manifest.json").read_text())["batch_size"])
    reference = reference_model(build_dir, source).train(training)
    pipeline = fxpipe.load_pipeline(build_dir).train(training)

    want_out, _ = _forward_backward(reference, source, batch)
    want_leaves, want_spec = tree_flatten(want_out)

    def restructure(output: Any) -> Any:  # a pipeline that lost the output structure: same leaves, original spec
        leaves = tree_leaves(output)
        if len(leaves) != len(want_leaves):
            raise ValueError(f"the pipeline returned {len(leaves)} outputs, the model {len(want_leaves)}")
        return tree_unflatten(leaves, want_spec)

    got_out, structure = _forward_backward(pipeline, source, batch, restructure)

    rows: list[tuple[str, float, bool]] = []
    got_leaves = tree_leaves(got_out)
    if len(got_leaves) != len(want_leaves):
        rows.append(("output count", math.inf, False))
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        rows.append((f"output[{i}]", *_diff(g, w)))

    held: dict[str, torch.Tensor] = {}
    held_buffers: dict[str, torch.Tensor] = {}
    for stage in pipeline.stages:
        held.update(stage.named_parameters(remove_duplicate=False))
        held_buffers.update(stage.named_buffers(remove_duplicate=False))
    names_of: dict[int, list[str]] = {}
    for key, p in reference.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(key)
    grads = 0
    for key, p in reference.named_parameters():
        mine = next((held[k] for k in names_of[id(p)] if k in held), None)
        if mine is None:
            if p.grad is not None and p.grad.any():
                rows.append((f"grad {key} (in no stage)", math.inf, False))
            continue
        grads += 1
        rows.append((f"grad {key}", *_diff(mine.grad, p.grad)))
    buffers = 0
    for key, b in reference.named_buffers():
        if key in held_buffers:
            buffers += 1
            rows.append((f"buffer {key}", *_diff(held_buffers[key], b)))

    failing = [r for r in rows if not r[2]]
    worst = max(failing or rows, key=lambda r: r[1], default=("", 0.0, True))
    return Comparison(training=training, ok=not failing, max_abs=max((r[1] for r in rows), default=0.0),
                      worst=worst[0], structure=structure, outputs=len(want_leaves), grads=grads, buffers=buffers,
                      failing=len(failing))
