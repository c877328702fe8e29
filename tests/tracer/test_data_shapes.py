"""Dimensions that depend on the data, found by one run on fake tensors (Note [data-dependent
shapes] in ``fxpipe.tracer.measure.data_shapes``): a packed ``h[mask]`` and what is computed from it, and a
node the fake run cannot go through standing in with its real value's shape."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

from fxpipe.tracer.measure.data_shapes import data_dependent_dims


@torch.fx.wrap
def _on_the_host(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.detach().numpy() * 2)  # no fake tensor has a numpy array


class _Packs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _on_the_host(self.lin(x))
        packed = h[mask]
        return packed * 2, h.sum(-1)


def test_a_packed_tensor_and_what_follows_it_depend_on_the_data() -> None:
    gm = torch.fx.symbolic_trace(_Packs())
    x, mask = torch.randn(2, 3, 4), torch.tensor([[True, False, True], [True, True, False]])
    values = torch.fx.Interpreter(gm, garbage_collect_values=False)
    values.run(x, mask)
    found = {
        n.name: dims
        for n, dims in data_dependent_dims(
            gm, (x, mask), lambda g: torch.fx.Interpreter(g), values.env
        ).items()
    }
    # _on_the_host fails on fake tensors: its real value's shape [2, 3, 4] stands in, and the run goes on
    assert found == {
        "getitem": frozenset({0}),
        "mul": frozenset({0}),
        "output": (frozenset({0}), None),
    }
    # without the real values the run cannot go on: nothing is found, the fitted formulas stand
    assert data_dependent_dims(gm, (x, mask), lambda g: torch.fx.Interpreter(g), {}) == {}
