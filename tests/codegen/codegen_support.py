"""Codegen test helpers: trace an example, plan it, write a build directory, compare with the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from fxpipe.codegen import Manifest, write_build_dir
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def build_example(
    out: Path,
    spec: str,
    stages: int,
    *,
    solver: str = "uniform",
    microbatch: int = 2,
    microbatches: int = 2,
    inputs_fn: str | None = None,
) -> tuple[Manifest, ModelSource]:
    """``spec`` is ``name`` or ``name:model_fn`` of a file in examples/."""
    name, _, fn = spec.partition(":")
    return build_model_file(
        out,
        EXAMPLES / f"{name}.py",
        stages,
        model_fn=fn or None,
        solver=solver,
        microbatch=microbatch,
        microbatches=microbatches,
        inputs_fn=inputs_fn,
    )


def build_model_file(
    out: Path,
    path: Path,
    stages: int,
    *,
    model_fn: str | None = None,
    solver: str = "uniform",
    microbatch: int = 2,
    microbatches: int = 2,
    inputs_fn: str | None = None,
    frontend: str = "auto",
) -> tuple[Manifest, ModelSource]:
    """Trace the model file ``path`` at ``microbatch`` (with ``frontend``), plan ``stages`` stages and
    write the build to ``out``."""
    source = load_model_file(path, model_fn=model_fn, inputs_fn=inputs_fn)
    traced = trace_model_file(source, microbatch, progress=False, frontend=frontend)
    plan = plan_partition(
        traced.profile, stages, solver=solver, microbatches=microbatches, time_limit=5.0
    )
    manifest = write_build_dir(
        traced, plan, out, source, batch_size=microbatch * microbatches, microbatches=microbatches
    )
    return manifest, source


def build_sources(out: Path, manifest: Manifest) -> str:
    """Every generated source of a build: the stage files and the classes they share (``shared.py``)."""
    files = [sm.source for sm in manifest.stages] + (
        [manifest.shared_source] if manifest.shared_source else []
    )
    return "\n".join((out / name).read_text() for name in files)


def reference_with_build_weights(
    source: ModelSource, manifest: Manifest, build_dir: Path
) -> nn.Module:
    """The original model, holding exactly the weights written to the build directory."""
    from safetensors.torch import load_file

    model = source.build_model()
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for sm in manifest.stages:
            for key, value in load_file(str(build_dir / sm.weights)).items():
                if key in state:
                    state[key].copy_(value)
    return model.train(manifest.training)


def assert_same_outputs_and_grads(
    reference: nn.Module, pipeline: Any, inputs: tuple[torch.Tensor, ...]
) -> None:
    """Outputs, every parameter gradient and every buffer afterwards equal (fp32, assert_close)."""
    want = reference(*inputs)
    got = pipeline(*inputs)
    assert type(got) is type(want)
    for g, w in zip(tree_leaves(got), tree_leaves(want), strict=True):
        torch.testing.assert_close(g, w)
    sum(t.sum() for t in tree_leaves(want) if t.is_floating_point()).backward()
    sum(t.sum() for t in tree_leaves(got) if t.is_floating_point()).backward()
    held: dict[str, torch.Tensor] = {}
    held_buffers: dict[str, torch.Tensor] = {}
    for stage in pipeline.stages:
        held.update(stage.named_parameters(remove_duplicate=False))
        held_buffers.update(stage.named_buffers(remove_duplicate=False))
    checked = 0
    for key, p in reference.named_parameters(remove_duplicate=False):
        if key in held:
            assert p.grad is not None, key
            torch.testing.assert_close(held[key].grad, p.grad, msg=lambda m: f"grad of {key}: {m}")
            checked += 1
    assert checked >= sum(1 for _ in reference.parameters())
    for key, b in reference.named_buffers():
        if key in held_buffers:
            torch.testing.assert_close(held_buffers[key], b, msg=lambda m: f"buffer {key}: {m}")


@pytest.fixture
def example_build(tmp_path: Path) -> Callable[..., tuple[Manifest, ModelSource, Path]]:
    def make(spec: str, stages: int, **kw: Any) -> tuple[Manifest, ModelSource, Path]:
        out = tmp_path / "build"
        manifest, source = build_example(out, spec, stages, **kw)
        return manifest, source, out

    return make
