"""In-place calls: found by the tracer, stale reads rewired, and what they change kept on one unit.

Note [in-place ops across stages] in ``fxpipe.tracer.frontend.mutation``; the models are ``tests/inplace_models.py``.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

import inplace_models
from fxpipe.graphmeta import GUARD_KEY, MUTATIONS_KEY
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model, trace_model_file
from fxpipe.tracer.traced import TracedModel

BATCH = 2


def _trace(factory: str, **options) -> TracedModel:
    return trace_model_file(
        load_model_file(inplace_models.__file__, model_fn=factory), BATCH, progress=False, **options
    )


def _node(traced: TracedModel, match) -> fx.Node:
    found = [n for n in traced.graph_module.graph.nodes if match(n)]
    assert len(found) == 1, found
    return found[0]


def _runs_like_the_model(traced: TracedModel, factory: str) -> None:
    """The rewired graph computes what the model computes (both from the same weights and inputs)."""
    model = getattr(inplace_models, factory)()
    model.load_state_dict(traced.model.state_dict())
    (x,) = inplace_models.example_inputs(BATCH)
    torch.testing.assert_close(traced.graph_module(x.clone())[0], model(x.clone()), rtol=0, atol=0)


def test_an_in_place_module_call_is_found_and_the_stale_read_after_it_rewired() -> None:
    traced = _trace("build_model")
    assert traced.graph_module.meta[MUTATIONS_KEY] == {"act": ("a",)}
    last = _node(traced, lambda n: n.op == "call_function" and n.target is operator.add)
    assert [a.name for a in last.all_input_nodes] == [
        "c",
        "act",
    ]  # `skip` was `a`: the ReLU changed it
    assert (
        traced.unit_of_node["a"] != traced.unit_of_node["act"]
    )  # nothing read `a` before the ReLU: free to split
    _runs_like_the_model(traced, "build_model")


def test_in_place_methods_and_functional_calls_are_found_too() -> None:
    traced = _trace("build_functional")
    gm = traced.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    calls = {by_name[name].target for name in gm.meta[MUTATIONS_KEY]}
    assert calls == {"mul_", "add_", torch.nn.functional.relu}
    last = _node(traced, lambda n: n.op == "call_function" and n.target is operator.add)
    assert by_name["a"] not in last.all_input_nodes
    _runs_like_the_model(traced, "build_functional")


def test_augmented_assignment_is_traced_in_place_and_each_version_stays_with_its_readers() -> None:
    traced = _trace("build_residual_stream")
    gm = traced.graph_module
    iadds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.iadd]
    assert (
        len(iadds) == 4
    )  # `h += block(h)`, not `h = h + block(h)`: the program changes h, and `first` with it
    assert set(gm.meta[MUTATIONS_KEY]) == {n.name for n in iadds}
    out = _node(traced, lambda n: n.op == "call_function" and n.target is operator.add)
    assert iadds[-1] in out.all_input_nodes and not any(
        n.name == "embed" for n in out.all_input_nodes
    )
    for k, iadd in enumerate(
        iadds
    ):  # the block that reads version k and the call that changes it: one unit
        first_read = next(u for u in iadd.args[0].users if u is not iadd)
        assert traced.unit_of_node[first_read.name] == traced.unit_of_node[iadd.name]
        assert traced.unit_of_node[iadd.name].startswith(f"blocks.{k}") or k == 0
    assert (
        len({traced.unit_of_node[n.name] for n in iadds}) == 4
    )  # the stream still splits between blocks
    _runs_like_the_model(traced, "build_residual_stream")


def test_a_write_through_a_view_keeps_the_viewed_tensor_its_writer_and_readers_before_it_on_one_unit() -> (
    None
):
    traced = _trace("build_view_write")
    relu_ = _node(traced, lambda n: n.op == "call_method" and n.target == "relu_")
    assert traced.unit_of_node["a"] == traced.unit_of_node[relu_.name]
    assert traced.unit_of_node["a"] != traced.unit_of_node["c"]
    _runs_like_the_model(traced, "build_view_write")


def test_an_in_place_call_of_one_mode_is_seen_and_keeps_what_it_changes_on_one_unit() -> None:
    traced = _trace("build_eval_only")
    mul_ = _node(traced, lambda n: n.op == "call_method" and n.target == "mul_")
    assert mul_.meta.get(GUARD_KEY) is False  # eval mode only
    assert traced.graph_module.meta[MUTATIONS_KEY] == {mul_.name: ("a",)}
    assert traced.unit_of_node["a"] == traced.unit_of_node[mul_.name]


class _ReturnsWhatItChanged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = (
            torch.nn.Linear(8, 8),
            torch.nn.ReLU(inplace=True),
            torch.nn.Linear(8, 8),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        skip = h
        return self.b(self.act(h)), skip  # skip is returned as the ReLU left it


def test_a_stale_model_output_is_rewired_too() -> None:
    model = _ReturnsWhatItChanged()
    x = torch.randn(4, 8)
    traced = trace_model(copy.deepcopy(model), (x,), progress=False)
    out = _node(traced, lambda n: n.op == "output")
    assert [a.name for a in out.all_input_nodes] == ["b", "act"]
    for got, want in zip(traced.graph_module(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _ItemAssignment(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * 2.0
        h[:, 0] = 0.0
        return self.b(h)


def test_item_assignment_traces_symbolically_as_setitem() -> None:
    model = _ItemAssignment()
    x = torch.randn(4, 8)
    traced = trace_model(copy.deepcopy(model), (x,), frontend="symbolic", progress=False)
    gm = traced.graph_module
    setitem = _node(traced, lambda n: n.op == "call_function" and n.target is operator.setitem)
    assert gm.meta[MUTATIONS_KEY] == {setitem.name: ("mul",)}
    torch.testing.assert_close(gm(x)[0], model(x), rtol=0, atol=0)


@pytest.mark.parametrize("factory", ["build_model", "build_functional", "build_residual_stream"])
def test_meta_tracing_finds_the_same_in_place_calls(factory: str) -> None:
    real = _trace(factory)
    meta = _trace(factory, trace_device="meta")
    assert meta.graph_module.meta[MUTATIONS_KEY] == real.graph_module.meta[MUTATIONS_KEY]
    assert meta.unit_of_node == real.unit_of_node
