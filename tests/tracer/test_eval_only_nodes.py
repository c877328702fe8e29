"""Shape propagation and unit counting run a merged graph in train mode, as the emitted code does
(Note [eval-only nodes in shape propagation] in ``fxpipe.tracer.measure.shapes``): a node that runs in eval
mode only, reading a ``train_or_eval`` whose train value has another shape (transformers' Mamba),
is not run on the train value; its spec comes from an eval-mode run, and it costs no FLOPs."""

from __future__ import annotations

import torch
import torch.fx

from fxpipe.graphmeta import GUARD_KEY, SPEC_KEY
from fxpipe.tracer.train_eval.modes import TRAINING_ATTR, run_in_mode, train_or_eval
from fxpipe.tracer.measure.shapes import propagate
from fxpipe.tracer.measure.unit_runner import UnitRunner
from fxpipe.tracer.units import UnitGroup


def _merged_graph() -> torch.fx.GraphModule:
    """``x * 2`` in train mode; ``dot(x.sum(0), x.sum(0))`` (a scalar) in eval mode, through a
    ``train_or_eval(training, x, x.sum(0))`` whose two values differ in shape."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    training = g.get_attr(TRAINING_ATTR)

    def call(name: str, target: object, *args: object) -> torch.fx.Node:
        return g.create_node("call_function", target, args, name=name)

    summed = call("summed", torch.ops.aten.sum.dim_IntList, x, [0])
    either = call("either", train_or_eval, training, x, summed)
    dot = call("dot", torch.ops.aten.dot.default, either, either)
    dot.meta[GUARD_KEY] = False  # eval mode only: a 2-D x would fail it
    doubled = call("doubled", torch.ops.aten.mul.Tensor, x, 2)
    doubled.meta[GUARD_KEY] = True
    out = call("out", train_or_eval, training, doubled, dot)
    g.output((out,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm.training = True
    return gm


def test_an_eval_only_node_is_not_run_on_train_values() -> None:
    gm = _merged_graph()
    x = torch.randn(4, 3)
    prop = propagate(gm, (x,), batch_size=4)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert nodes["dot"].meta[SPEC_KEY].shape == ()  # the eval-mode value
    assert nodes["doubled"].meta[SPEC_KEY].shape == (4, 3)
    assert nodes["out"].meta[SPEC_KEY].shape == (4, 3)  # train mode's output
    assert prop.flops["dot"] == 0.0
    want = run_in_mode(gm, (x,), training=False)[nodes["dot"]]
    torch.testing.assert_close(prop.values[nodes["dot"]], want)

    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    group = UnitGroup(
        name="all",
        path="",
        kind="ops",
        nodes=tuple(names),
        inputs=("x",),
        outputs=("out",),
        get_attrs=("training",),
        reads_inputs=(0,),
    )
    (got,) = UnitRunner(gm, group, prop.values).forward()[0]
    torch.testing.assert_close(got, x * 2)
