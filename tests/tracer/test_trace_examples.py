"""Every example traces; its normalized graph, shapes and parameter bytes match eager PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from example_models import EXAMPLES
from fxpipe.tracer import TensorSpec, trace_model, trace_model_file
from fxpipe.graphmeta import PATH_KEY, SPEC_KEY
from fxpipe.tracer.units import COMPUTE_OPS


@pytest.fixture(scope="module")
def traced_examples():
    from fxpipe.modelfile import load_model_file

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, path in EXAMPLES.items():
            torch.manual_seed(0)
            out[name] = trace_model_file(load_model_file(path), batch_size=2, progress=False)
    return out


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_graph_equals_eager_at_other_batches(traced_examples, load_example, name):
    traced = traced_examples[name]
    source = load_example(name)
    for batch in (1, 3):
        inputs = source.example_inputs(batch)
        with torch.no_grad():
            expected = traced.model(*inputs)
            flat = traced.graph_module(*inputs)
        assert isinstance(flat, tuple) and all(isinstance(t, torch.Tensor) for t in flat)
        torch.testing.assert_close(traced.unflatten_output(flat), expected)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_normalized_graph_contract(traced_examples, name):
    traced = traced_examples[name]
    gm = traced.graph_module
    n_inputs = len(traced.example_inputs)
    assert [n.op for n in gm.graph.nodes][:n_inputs] == ["placeholder"] * n_inputs
    for node in gm.graph.nodes:
        assert PATH_KEY in node.meta, node
        if node.op != "output":
            assert SPEC_KEY in node.meta, node
        if node.op in COMPUTE_OPS:
            assert node.name in traced.unit_of_node
        if node.op == "get_attr":
            assert str(node.target) in dict(
                traced.model.named_parameters(remove_duplicate=False)
            ) | dict(traced.model.named_buffers(remove_duplicate=False)) | {
                c: None for c in gm.meta["fxpipe_constants"]
            }
    # values crossing units are tensors or ints, never tuples
    for unit in traced.profile.units:
        assert all(isinstance(o, TensorSpec) for o in unit.outputs)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_leaf_output_shapes_equal_eager(traced_examples, name):
    traced = traced_examples[name]
    shapes: dict[str, list[tuple[int, ...]]] = {}
    hooks = [
        m.register_forward_hook(
            lambda mod, args, out, path=path: shapes.setdefault(path, []).append(tuple(out.shape))
        )
        for path, m in traced.model.named_modules()
        if path in traced.leaf_modules
    ]
    try:
        with torch.no_grad():
            traced.model(*traced.example_inputs)
    finally:
        for h in hooks:
            h.remove()
    calls = [n for n in traced.graph_module.graph.nodes if n.op == "call_module"]
    assert calls
    for node in calls:
        assert node.meta[SPEC_KEY].shape == shapes[str(node.target)][0]
        assert node.meta[SPEC_KEY].batch_dim == 0


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_param_bytes_equal_model(traced_examples, name):
    traced = traced_examples[name]
    unique = {id(p): p.numel() * p.element_size() for p in traced.model.parameters()}
    assert traced.profile.total_param_bytes == sum(unique.values())
    assert sum(traced.profile.param_sizes.values()) == sum(unique.values())


def test_gpt_tied_embedding_counted_once(traced_examples):
    profile = traced_examples["gpt"].profile
    assert ("wte.weight", "lm_head.weight") in profile.ties
    lm_head = next(u for u in profile.units if u.module_path == "lm_head")
    assert lm_head.param_bytes == 0 and lm_head.params == ("lm_head.weight",)


def test_branchy_is_a_dag_with_two_inputs(traced_examples):
    profile = traced_examples["branchy"].profile
    assert len(profile.inputs) == 2 and not profile.is_chain
    readers = {i: [u.name for u in profile.units if i in u.reads_inputs] for i in (0, 1)}
    assert readers[0] and readers[1]
    g = profile.graph()
    # enc_x branches into left, right and the skip connection; the concatenation merges left and right
    assert set(g.successors("enc_x.1")) >= {"left.0", "right.0"}
    assert max(g.in_degree(n) for n in g.nodes) >= 2


def test_resnet_batchnorm_state_is_untouched(load_example):
    model = load_example("resnet").build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace_model(model, load_example("resnet").example_inputs(2), progress=False, frontend="export")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def test_requires_grad_and_batch_dim_of_specs(traced_examples):
    gm = traced_examples["gpt"].graph_module
    idx = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert idx.meta[SPEC_KEY] == TensorSpec((2, 16), "int64", 0, False, ("mb", "16"))
    wpe = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "wpe")
    assert wpe.meta[SPEC_KEY].batch_dim is None and wpe.meta[SPEC_KEY].requires_grad
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out.meta[SPEC_KEY] == TensorSpec((2, 16, 64), "float32", 0, True, ("mb", "16", "64"))


def test_unit_outputs_have_int_spec_for_sizes():
    class SizeUser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h).view(h.size(0), -1)

    traced = trace_model(SizeUser(), (torch.randn(3, 4),), progress=False)
    torch.testing.assert_close(traced.graph_module(torch.randn(5, 4))[0].shape, torch.Size([5, 4]))
    assert pytree.tree_flatten(traced.profile.units)[0]
