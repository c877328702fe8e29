"""Which tensor dimensions depend on the data: one run of the graph on fake tensors with a shape
environment, where an op whose output size depends on values (``x[mask]``, ``nonzero``,
``masked_select``, ``unique``) gives an unbacked symbol that every later size carrying it shows.

Note [data-dependent shapes]: the shape formulas (Note [shape formulas] in
``fxpipe.shapeformula``) are fitted from runs at other sizes, and those runs repeat the example's
data: concatenating a batch with itself doubles the number of ``True`` entries in a mask too, so a
packed ``h[mask]`` of 6 rows at microbatch 2 and 12 at 4 passes for ``3*mb``. The fake run below
tells such dimensions apart whatever the numbers: they have the formula ``"?"``, the manifest marks
their tensors data-dependent (``BoundaryTensor.data_dependent``), and the runtime sends such a
tensor's shape ahead of it (Note [data-dependent messages] in ``fxpipe.runtime.pipeline.stage_io``).
Sizes computed from a data-dependent size (``packed.size(0) * 2``) carry its symbol and are found
too. A node the fake run cannot go through (an op without a fake kernel, Python control flow on
a data-dependent size inside a leaf module) takes the shape of its real value, so a size such a
node makes from the data keeps its fitted formula; a sender still checks every tensor's shape
against its formula before the message goes out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx

__all__ = ["DataDims", "data_dependent_dims"]

DataDims = Any  # per node: the dims (a frozenset) of a tensor value, or a tuple of them for a tuple


def data_dependent_dims(
    gm: torch.fx.GraphModule,
    inputs: tuple[torch.Tensor, ...],
    runner: Callable[[torch.fx.GraphModule], torch.fx.Interpreter],
    values: Mapping[torch.fx.Node, Any],
) -> dict[torch.fx.Node, DataDims]:
    """The nodes whose value has a dimension that depends on the data, each with those dimensions
    (a ``frozenset`` for a tensor, a tuple of them for a tuple).

    ``runner`` makes the interpreter that runs the graph (the tracer's, which knows the merged
    train/eval graph's flags); ``values``: every node's value in a real run, the shapes of the nodes
    the fake run cannot go through (a leaf module that loops over a data-dependent tensor, as
    Mixtral's experts do: their outputs count as shapes the data does not move)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._pytree import tree_map_only

    if not any(isinstance(t, torch.Tensor) for t in inputs):
        return {}
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    def static(value: Any) -> Any:
        return tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t, static_shapes=True), value)

    run = runner(gm)
    through = run.run_node
    found: dict[torch.fx.Node, DataDims] = {}

    def run_node(n: torch.fx.Node) -> Any:
        try:
            value = through(n)
        except Exception:  # noqa: BLE001 - its real value's shape stands in (see the docstring)
            if n not in values:
                raise
            return static(values[n])
        dims = _unbacked(value)
        if dims is not None:
            found[n] = dims
        return value

    run.run_node = run_node  # type: ignore[method-assign]
    try:
        with mode, torch.no_grad():
            run.run(*static(inputs))
    except Exception:  # noqa: BLE001 - the fitted formulas stand (see the Note)
        return {}
    return found


def _unbacked(value: Any) -> DataDims:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(value, torch.Tensor):
        dims = frozenset(d for d, s in enumerate(value.shape) if free_unbacked_symbols(s))
        return dims or None
    if isinstance(value, (tuple, list)):
        parts = tuple(_unbacked(v) for v in value)
        return parts if any(p is not None for p in parts) else None
    return None
