"""Both modes in one graph: the merge of the train- and eval-mode traces, one test per way they differ.

Each case traces a model of ``tests/mode_models.py`` and checks (a) the form of the merged graph
(which arguments read ``training``, which nodes are guarded) and (b) that the merged graph,
run in each mode (``ModeInterpreter``), gives the model's own outputs in that mode from the
same seed.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from fxpipe.graphmeta import GUARD_KEY
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model_file
from fxpipe.tracer.train_eval.merge import merge_modes
from fxpipe.tracer.train_eval.modes import (
    guard_of,
    guarded_regions,
    is_training_flag,
    run_in_mode,
    train_or_eval,
)
from fxpipe.tracer.traced import TracedModel

MODELS = Path(__file__).resolve().parents[1] / "mode_models.py"


def _trace(factory: str, frontend: str, inputs_fn: str = "sequence_inputs") -> TracedModel:
    source = load_model_file(MODELS, model_fn=factory, inputs_fn=inputs_fn)
    return trace_model_file(source, 2, frontend=frontend, progress=False)


def _assert_graph_is_model_in_both_modes(traced: TracedModel) -> None:
    model, gm, inputs = traced.model, traced.graph_module, traced.example_inputs
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for training in (True, False):
        model.train(training)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(5)
            want = model(*inputs)
            torch.manual_seed(5)
            env = run_in_mode(gm, inputs, training)
        torch.testing.assert_close(env[out.args[0][0]], want, rtol=0, atol=0)
    model.train()


def _reads_flag(node: fx.Node) -> bool:
    return any(is_training_flag(a) for a in node.all_input_nodes)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_a_flipped_flag_reads_training(frontend: str) -> None:
    traced = _trace("build_flip", frontend)
    dropouts = [n for n in traced.graph_module.graph.nodes if "dropout" in str(n.target)]
    assert len(dropouts) == 1 and _reads_flag(dropouts[0])
    assert not any(guard_of(n) is not None for n in traced.graph_module.graph.nodes)
    _assert_graph_is_model_in_both_modes(traced)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_p_against_zero_becomes_a_switch(frontend: str) -> None:
    traced = _trace("build_p_zero", frontend)
    switches = [n for n in traced.graph_module.graph.nodes if n.target is train_or_eval]
    assert [tuple(s.args[1:]) for s in switches] == [(0.3, 0.0)]
    assert "scaled_dot_product_attention" in str(next(iter(switches[0].users)).target)
    _assert_graph_is_model_in_both_modes(traced)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_a_train_only_contiguous_stays_unguarded(frontend: str) -> None:
    traced = _trace("build_contiguous", frontend)
    nodes = list(traced.graph_module.graph.nodes)
    assert any("contiguous" in str(n.target) for n in nodes)
    assert not any(
        guard_of(n) is not None or n.target is train_or_eval or _reads_flag(n) for n in nodes
    )
    _assert_graph_is_model_in_both_modes(traced)


def test_batch_norm_counter_is_a_train_only_side_effect() -> None:
    traced = _trace("build_model", "export", "example_inputs")
    nodes = list(traced.graph_module.graph.nodes)
    counters = [n for n in nodes if n.target is torch.ops.aten.add_.Tensor]
    assert len(counters) == 4 and all(guard_of(n) is True and not n.users for n in counters)
    norms = [n for n in nodes if n.target is torch.ops.aten.batch_norm.default]
    assert len(norms) == 4 and all(_reads_flag(n) for n in norms)
    _assert_graph_is_model_in_both_modes(traced)


def test_stochastic_depth_inlined_is_a_conditional_region_in_one_unit() -> None:
    traced = _trace("build_model", "export", "example_inputs")
    graph = traced.graph_module.graph
    regions = guarded_regions(graph)
    assert (
        len(regions) == 3
    )  # one per block: empty, bernoulli_, div_, mul and the switch that reads them
    for region in regions:
        switch = [n for n in region if n.target is train_or_eval]
        assert len(switch) == 1 and {guard_of(n) for n in region if n not in switch} == {True}
        assert any(n.target is torch.ops.aten.bernoulli_.float for n in region)
        assert len({traced.unit_of_node[n.name] for n in region}) == 1
    _assert_graph_is_model_in_both_modes(traced)


def test_stochastic_depth_on_the_symbolic_path_reads_training() -> None:
    traced = _trace("build_model", "symbolic", "example_inputs")
    calls = [
        n
        for n in traced.graph_module.graph.nodes
        if getattr(n.target, "__name__", "") == "stochastic_depth"
    ]
    assert len(calls) == 3 and all(is_training_flag(c.args[3]) for c in calls)
    _assert_graph_is_model_in_both_modes(traced)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_an_eval_only_node_is_guarded_and_switched(frontend: str) -> None:
    traced = _trace("build_eval_only", frontend)
    nodes = list(traced.graph_module.graph.nodes)
    eval_only = [n for n in nodes if guard_of(n) is False]
    assert len(eval_only) == 1
    (switch,) = eval_only[0].users
    assert switch.target is train_or_eval and switch.args[2] is eval_only[0]
    _assert_graph_is_model_in_both_modes(traced)


def test_merging_identical_graphs_changes_nothing() -> None:
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    other = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    before = gm.code
    summary = merge_modes(gm, other)
    assert summary.same and gm.code == before
    assert not any(GUARD_KEY in n.meta for n in gm.graph.nodes)


def test_random_units_are_marked_in_the_profile() -> None:
    traced = _trace("build_branchy", "symbolic")
    random = {u.module_path for u in traced.profile.units if u.random}
    assert random == {"left.2", "right.2"}


def test_tracing_leaves_the_model_modes_and_buffers_as_they_were() -> None:
    source = load_model_file(MODELS, inputs_fn="example_inputs")
    model = source.build_model()
    model.eval()
    model.blocks[1].train()
    stats = model.stem[1].running_mean.clone()
    from fxpipe.tracer import trace_model

    traced = trace_model(model, source.example_inputs(2), frontend="export", progress=False)
    assert [m.training for m in model.modules()] == [
        m is model.blocks[1] or _under(model.blocks[1], m) for m in model.modules()
    ]
    assert torch.equal(model.stem[1].running_mean, stats)
    assert any(n.target is operator.not_ or _reads_flag(n) for n in traced.graph_module.graph.nodes)


def _under(parent: torch.nn.Module, module: torch.nn.Module) -> bool:
    return any(m is module for m in parent.modules())
