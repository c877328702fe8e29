"""Hugging Face GPT-2 and BERT trace through ``torch.export`` into the normalized graph."""

from __future__ import annotations

import sys

import pytest
import torch

from example_models import HF_MODELS
from fxpipe.tracer import trace_model
from fxpipe.graphmeta import SPEC_KEY

pytest.importorskip("transformers")
sys.path.insert(0, str(HF_MODELS.parent))
import hf_models  # noqa: E402


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    return trace_model(hf_models.build_gpt2(), hf_models.example_inputs(2), progress=False)


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    return trace_model(hf_models.build_bert(), hf_models.bert_inputs(2), progress=False)


def test_gpt2_uses_export_and_units_map_to_module_paths(gpt2):
    assert gpt2.frontend == "export" and gpt2.profile.frontend == "export"
    modules = dict(gpt2.model.named_modules())
    for unit in gpt2.profile.units:
        assert unit.module_path in modules, unit
    paths = {u.module_path for u in gpt2.profile.units}
    assert {
        "model.transformer.h.0.attn.c_attn",
        "model.transformer.h.1.mlp.c_fc",
        "model.lm_head",
    } <= paths
    assert gpt2.profile.module_order.index(
        "model.transformer.h.0"
    ) < gpt2.profile.module_order.index("model.transformer.h.1")


def test_gpt2_parameters_keep_original_names_and_ties(gpt2):
    names = {str(n.target) for n in gpt2.graph_module.graph.nodes if n.op == "get_attr"}
    assert "model.transformer.h.0.attn.c_attn.weight" in names
    assert ("model.transformer.wte.weight", "model.lm_head.weight") in gpt2.profile.ties
    unique = {id(p): p.numel() * 4 for p in gpt2.model.parameters()}
    assert gpt2.profile.total_param_bytes == sum(unique.values())


@pytest.mark.parametrize("batch", [1, 3])
def test_gpt2_dynamic_batch_equals_eager(gpt2, batch):
    inputs = hf_models.example_inputs(batch)
    with torch.no_grad():
        torch.testing.assert_close(
            gpt2.unflatten_output(gpt2.graph_module(*inputs)), gpt2.model(*inputs)
        )


@pytest.mark.parametrize("batch", [1, 3])
def test_bert_output_structure_and_dynamic_batch(bert, batch):
    inputs = hf_models.bert_inputs(batch)
    with torch.no_grad():
        expected = bert.model(*inputs)
        got = bert.unflatten_output(bert.graph_module(*inputs))
    assert type(got) is type(expected)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output)


def test_bert_constants_and_input_specs(bert):
    # non-persistent buffers must be registered as such so state_dict keys stay equal
    assert "embeddings.position_ids" in bert.graph_module.meta["fxpipe_constants"]
    ids, mask = bert.profile.inputs
    assert ids.dtype == "int64" and not ids.requires_grad and mask.batch_dim == 0
    assert all(u.module_path in dict(bert.model.named_modules()) for u in bert.profile.units)


def test_export_traced_at_batch_one_stays_dynamic():
    traced = trace_model(
        hf_models.build_gpt2(), hf_models.example_inputs(1), frontend="export", progress=False
    )
    out = next(n for n in traced.graph_module.graph.nodes if n.op == "output").args[0][0]
    assert out.meta[SPEC_KEY].shape[0] == 1 and out.meta[SPEC_KEY].batch_dim == 0
    inputs = hf_models.example_inputs(4)
    with torch.no_grad():
        torch.testing.assert_close(traced.graph_module(*inputs)[0], traced.model(*inputs))
