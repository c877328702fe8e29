"""Stages traced on the CPU run on a GPU (Note [device literals]) and compute what the original computes there."""

from __future__ import annotations

import pytest
import torch
from codegen_support import (
    assert_same_outputs_and_grads,
    example_build,
    reference_with_build_weights,
)  # noqa: F401 (fixture)

from fxpipe.codegen import load_pipeline

CASES = [
    ("gpt", "example_inputs"),
    ("hf_models", "example_inputs"),
    ("hf_models:build_bert", "bert_inputs"),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec,inputs_fn", CASES)
def test_stages_run_on_cuda(example_build, spec: str, inputs_fn: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    manifest, source, out = example_build(spec, 2, inputs_fn=inputs_fn)
    pipeline = load_pipeline(out, device="cuda")
    reference = reference_with_build_weights(source, manifest, out).cuda()
    pipeline.train(reference.training)
    inputs = tuple(x.cuda() for x in source.example_inputs(3))
    assert_same_outputs_and_grads(reference, pipeline, inputs)
