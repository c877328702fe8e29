"""Units: ``join_units`` merges only the units a set of nodes spans (a mode-guarded region), nothing after it."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from fxpipe.graphmeta import PATH_KEY
from fxpipe.tracer.units import group_units, join_units


def _five_leaf_units() -> fx.GraphModule:
    gm = fx.symbolic_trace(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    )
    for node in gm.graph.nodes:
        if node.op == "call_module":
            node.meta[PATH_KEY] = node.target
    return gm


def test_join_units_merges_the_spanned_units_and_keeps_the_others() -> None:
    gm = _five_leaf_units()
    groups = group_units(gm, {})
    assert [g.nodes for g in groups] == [("_0",), ("_1",), ("_2",), ("_3",), ("_4",)]
    joined = join_units(gm, groups, [{"_1", "_2"}])
    assert [g.nodes for g in joined] == [("_0",), ("_1", "_2"), ("_3",), ("_4",)]
    assert joined[1].kind == "ops" and joined[1].inputs == ("_0",) and joined[1].outputs == ("_2",)


def test_join_units_chains_overlapping_sets_and_leaves_disjoint_ones_apart() -> None:
    gm = _five_leaf_units()
    groups = group_units(gm, {})
    joined = join_units(gm, groups, [{"_0", "_1"}, {"_1", "_2"}, {"_3"}])
    assert [g.nodes for g in joined] == [("_0", "_1", "_2"), ("_3",), ("_4",)]
    assert join_units(gm, groups, []) == groups
