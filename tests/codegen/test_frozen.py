"""Frozen parameters stay frozen in the stages (issue 37, Note [frozen parameters] in fxpipe.codegen.graph.ownership).

A parameter with ``requires_grad=False`` in the model is frozen in the emitted stage, after loading
and in the pipeline: it gets no gradient (None, as in the model), and the safety net refuses a stage
whose flag differs from the model's even where the gradient would be zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from codegen_support import build_model_file, build_sources

from fxpipe.codegen import load_pipeline, load_stage, verify_build
from fxpipe.codegen.check.equivalence import compare_in_mode, probe_loss

MODELS = Path(__file__).resolve().parent / "frozen_models.py"


def _frozen(model: torch.nn.Module) -> set[str]:
    return {k for k, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_frozen_parameters_stay_frozen_in_every_stage(tmp_path: Path, frontend: str) -> None:
    out = tmp_path / "build"
    manifest, source = build_model_file(out, MODELS, 3, frontend=frontend)  # the safety net passes
    model = source.build_model()
    want = _frozen(model)
    assert len(want) == 10
    got: set[str] = set()
    for i in range(3):
        stage = load_stage(out, i)
        got |= _frozen(stage)
        trainable = {k for k, p in stage.named_parameters() if p.requires_grad}
        assert not trainable & want
    assert got == want
    assert "requires_grad_(False)" in build_sources(out, manifest)
    pipeline = load_pipeline(out)
    ids = source.example_inputs(4)[0]
    pipeline(ids).sum().backward()
    for stage in pipeline.stages:
        for key, p in stage.named_parameters():
            assert (p.grad is None) == (key in want), key
    assert verify_build(out).ok


def test_a_frozen_parameter_made_trainable_is_a_mismatch_even_with_a_zero_gradient(
    tmp_path: Path,
) -> None:
    out = tmp_path / "build"
    _, source = build_model_file(out, MODELS, 2)
    model = source.build_model()
    pipeline = load_pipeline(out)
    inputs = source.example_inputs(2)
    run = lambda m: m(*inputs)  # noqa: E731
    assert compare_in_mode(model, pipeline, pipeline.stages, run, training=True).ok
    stage = next(s for s in pipeline.stages if "embed.weight" in dict(s.named_parameters()))
    stage.get_parameter("embed.weight").requires_grad_(True)
    zero = lambda output: probe_loss(output) * 0.0  # noqa: E731 - every gradient zero
    result = compare_in_mode(model, pipeline, pipeline.stages, run, training=True, loss=zero)
    assert [e.name for e in result.failing] == ["requires_grad embed.weight"]
