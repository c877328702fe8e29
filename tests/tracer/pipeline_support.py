"""Partition a model file and compare the chained stages with the original, for the root-cause tests.

``partition_file`` traces, plans and writes a build directory; ``assert_pipeline_matches``
rebuilds the original with the build's weights and checks, fp32 and tight
(``torch.testing.assert_close`` defaults), outputs, every parameter gradient and every buffer
afterwards, both sides run from the same seed in the same mode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from fxpipe.codegen import load_pipeline, write_build_dir
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import TracedModel, trace_model_file

MODELS = Path(__file__).resolve().parent / "models"


def partition_file(
    spec: str | Path, stages: int, out: Path, *, frontend: str = "auto", microbatch: int = 2
) -> tuple[TracedModel, ModelSource]:
    """Trace ``spec`` (a model file, ``path.py:factory`` allowed), cut it into ``stages`` and write ``out``."""
    source = load_model_file(spec)
    traced = trace_model_file(source, microbatch, frontend=frontend, progress=False)
    plan = plan_partition(traced.profile, stages, solver="dp", microbatches=stages)
    write_build_dir(traced, plan, out, source, batch_size=microbatch * stages, microbatches=stages)
    return traced, source


def _reference(source: ModelSource, build: Path) -> nn.Module:
    from safetensors.torch import load_file

    model = source.build_model()
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(
        model.named_buffers(remove_duplicate=False)
    )
    with torch.no_grad():
        for stage in json.loads((build / "manifest.json").read_text())["stages"]:
            for key, value in load_file(str(build / stage["weights"])).items():
                state[key].copy_(value)
    return model


def _step(model: nn.Module, source: ModelSource, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model(*inputs)
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    sum(
        (t.float() * (i + 1)).sum() for i, t in enumerate(leaves) if t.is_floating_point()
    ).backward()
    return leaves


def assert_pipeline_matches(
    build: Path, source: ModelSource, *, training: bool = True, batch: int = 3
) -> None:
    """The chained stages of ``build`` compute what ``source.build_model()`` computes (module docstring)."""
    reference = _reference(source, build).train(training)
    pipeline = load_pipeline(build).train(training)
    inputs = source.example_inputs(batch)
    want, got = _step(reference, source, inputs), _step(pipeline, source, inputs)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, msg=lambda m: f"output {i}: {m}")
    held = {
        k: p for stage in pipeline.stages for k, p in stage.named_parameters(remove_duplicate=False)
    }
    buffers = {
        k: b for stage in pipeline.stages for k, b in stage.named_buffers(remove_duplicate=False)
    }
    for key, p in reference.named_parameters():
        torch.testing.assert_close(held[key].grad, p.grad, msg=lambda m: f"grad of {key}: {m}")
    for key, b in reference.named_buffers():
        torch.testing.assert_close(buffers[key], b, msg=lambda m: f"buffer {key}: {m}")
