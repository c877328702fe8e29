"""Round trips: trace -> plan -> emit -> load, compared with the original model in fp32."""

from __future__ import annotations

import pytest
import torch
from codegen_support import (
    assert_same_outputs_and_grads,
    example_build,
    reference_with_build_weights,
)  # noqa: F401 (fixture)

from fxpipe.codegen import INPUT, load_pipeline, verify_build

CASES = [  # example, stages, solver
    ("mlp", 2, "uniform"),
    ("mlp", 4, "dp"),
    (
        "gpt",
        3,
        "params",
    ),  # tied wte/lm_head, user-defined leaf (CausalSelfAttention), bare Parameter
    ("gpt", 2, "cpsat"),
    ("resnet", 4, "greedy"),  # BatchNorm running stats, residual adds
    ("branchy", 3, "dp"),  # two inputs, branches, skip connection
    ("branchy", 4, "uniform"),
]


@pytest.mark.parametrize("spec,stages,solver", CASES)
def test_pipeline_matches_original(example_build, spec: str, stages: int, solver: str) -> None:
    manifest, source, out = example_build(spec, stages, solver=solver)
    assert manifest.num_stages == stages
    pipeline = load_pipeline(out)
    reference = reference_with_build_weights(source, manifest, out)
    pipeline.train(reference.training)
    # 3 is neither the traced microbatch (2) nor the batch (4): no batch size is baked in
    assert_same_outputs_and_grads(reference, pipeline, source.example_inputs(3))

    report = verify_build(out)
    assert report.ok, report.summary()
    assert [len(m.grads) for m in report.modes] == [sum(1 for _ in reference.parameters())] * 2


def test_stage_state_dicts_partition_the_original(example_build) -> None:
    manifest, source, out = example_build("resnet", 3, solver="params")
    pipeline = load_pipeline(out)
    reference = reference_with_build_weights(source, manifest, out)
    union: dict[str, torch.Tensor] = {}
    for stage, sm in zip(pipeline.stages, manifest.stages):
        state = stage.state_dict()
        assert set(state) == set(sm.parameters) | set(sm.buffers)
        union.update(state)
    assert set(union) == set(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(union[key], value)


def test_tied_weights_are_shared_and_recorded(example_build) -> None:
    manifest, _, out = example_build("gpt", 3, solver="uniform")
    (tie,) = manifest.ties
    assert tie.stages == (0, 2) and tie.keys == ("wte.weight", "lm_head.weight")
    pipeline = load_pipeline(out)
    assert pipeline.stages[0].get_parameter("wte.weight") is pipeline.stages[2].get_parameter(
        "lm_head.weight"
    )


def test_gpt_stage_imports_user_leaf_from_model_file(example_build) -> None:
    import sys

    manifest, source, out = example_build("gpt", 2, solver="uniform")
    text = (out / "stage_0.py").read_text() + (
        out / manifest.shared_source
    ).read_text()  # Block is in both stages
    assert "_model.CausalSelfAttention(32, 4, 16)" in text and manifest.stages[0].imports_model_file
    stage = load_pipeline(out).stages[0]
    attn = stage.get_submodule("blocks.0.attn")
    assert type(attn) is source.module.CausalSelfAttention
    assert attn.mask.device.type == "cpu" and torch.equal(
        attn.mask, source.build_model().blocks[0].attn.mask
    )
    assert source.module is sys.modules[type(attn).__module__]


def test_skip_connection_jumps_over_a_stage(example_build) -> None:
    manifest, _, out = example_build("branchy", 4, solver="uniform")
    skips = [
        t
        for sm in manifest.stages
        for t in sm.outputs
        if any(c > t.producer + 1 for c in t.consumers)
    ]
    assert skips, "expected the x-encoder's skip connection to bypass a stage"
    assert {t.name for t in manifest.inputs} == {"x", "y"}
    assert all(t.producer == INPUT for t in manifest.inputs)
    assert manifest.stages[-1].outputs[-1].model_output == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_fn,inputs_fn,stages",
    [("build_model", "example_inputs", 3), ("build_bert", "bert_inputs", 2)],
)
def test_hugging_face_models_via_export(
    example_build, model_fn: str, inputs_fn: str, stages: int
) -> None:
    manifest, source, out = example_build(
        f"hf_models:{model_fn}", stages, solver="uniform", inputs_fn=inputs_fn
    )
    assert manifest.frontend == "export"
    text = "".join((out / sm.source).read_text() for sm in manifest.stages)
    assert "device(type=" not in text  # device literals are rewritten to the inputs' device
    pipeline = load_pipeline(out)
    reference = reference_with_build_weights(source, manifest, out)
    pipeline.train(reference.training)
    assert_same_outputs_and_grads(reference, pipeline, source.example_inputs(3))
    if model_fn == "build_model":
        assert manifest.ties and manifest.ties[0].keys == (
            "model.transformer.wte.weight",
            "model.lm_head.weight",
        )
