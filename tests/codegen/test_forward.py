"""The forward renderer: operators infix, slice syntax, ``F.``, tuple unpacking, values dropped after their last use,
and the rendered function computes what the graph computes."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe.codegen.render.forward import render_forward, run_blocks
from fxpipe.codegen.render.pyrender import ImportTable


def _render(g: fx.Graph) -> tuple[str, Any]:
    imports = ImportTable()
    lines = render_forward(g, imports, lambda target: f"self.{target}")
    source = "\n".join(imports.lines() + lines)
    namespace: dict[str, Any] = {}
    exec(compile(source, "<forward>", "exec"), namespace)  # noqa: S102 - our own rendered source
    return source, namespace["forward"]


def test_graph_written_as_pytorch_and_run() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 6)
    t = g.call_method("size", (x, 1))
    sliced = g.call_function(operator.getitem, (x, (slice(None), slice(None, t, 2))))
    split = g.call_method("split", (x, 2, 1))
    split.meta["val"] = (None, None, None)  # a 3-tuple: written as `a, b, c = ...`
    q, k, v = (g.call_function(operator.getitem, (split, j)) for j in range(3))
    pooled = g.call_function(
        F.max_pool2d, (g.call_method("view", (x, [1, 2, 2, 3])), 2)
    )  # a boolean_dispatch function
    total = g.call_function(operator.add, (g.call_function(operator.mul, (q, k)), v))
    g.output((sliced, total, pooled, g.call_function(operator.neg, (t,))))
    source, forward = _render(g)
    assert "getitem = x[:, :size:2]" in source
    assert (
        "split_0, split_1, split_2 = x.split(2, 1);  x = None" not in source
    )  # x is still read after
    assert "split_0, split_1, split_2 = x.split(2, 1)" in source
    assert "F.max_pool2d(view, 2)" in source and "import torch.nn.functional as F" in source
    assert (
        "mul = split_0 * split_1\n" in source
    )  # no free: no value has a size, none lowers the peak
    assert "return (getitem, add, max_pool2d, neg)" in source
    data = torch.randn(2, 6)
    q_, k_, v_ = data.split(2, 1)
    got = forward(None, data)
    want = (data[:, :6:2], q_ * k_ + v_, F.max_pool2d(data.view(1, 2, 2, 3), 2), -6)
    for a, b in zip(got, want):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_run_of_blocks_is_a_loop() -> None:
    g = fx.Graph()
    x, mask = g.placeholder("x"), g.placeholder("mask")
    out = g.call_function(run_blocks, ("h", 2, 5, x, mask))
    g.output((out,))
    source, forward = _render(g)
    assert (
        "run_blocks = x\n    for i in range(2, 5):\n        run_blocks = self.h[str(i)](run_blocks, mask)\n"
        in source
    )
    assert "= None" not in source  # the arguments are the caller's: freeing them frees nothing

    class Holder:
        h = {str(i): (lambda y, m, i=i: y * i + m) for i in range(2, 5)}

    (result,) = forward(Holder(), torch.tensor(1.0), torch.tensor(1.0))
    assert result.item() == ((1 * 2 + 1) * 3 + 1) * 4 + 1
