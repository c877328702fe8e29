"""Units that change their inputs in place (Note [fresh unit inputs] in fxpipe.tracer.measure.unit_runner).

``nn.ReLU(inplace=True)``, ``out += identity`` and export's ``add_`` used to crash cost counting
("a leaf Variable that requires grad is being used in an in-place operation") and, where they
did not, overwrote the recorded values other units read (T5's relative-position buckets then
indexed out of range).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from pipeline_support import MODELS, assert_pipeline_matches, partition_file

from fxpipe.tracer.measure.counting import count_unit
from fxpipe.tracer.measure.shapes import propagate
from fxpipe.tracer.frontend.symbolic import symbolic_trace
from fxpipe.tracer.measure.timing import measure_ms
from fxpipe.tracer.measure.unit_runner import UnitRunner
from fxpipe.tracer.units import group_units


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        out += x
        index += 1  # an integer input changed in place, then used to index
        return self.relu(out)[:, :3] * x[:, index]


def _runners(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[UnitRunner]:
    gm = symbolic_trace(model, len(inputs)).graph_module
    prop = propagate(gm, inputs, inputs[0].shape[0], (0,) + (None,) * (len(inputs) - 1))
    return [UnitRunner(gm, g, prop.values) for g in group_units(gm, prop.flops)]


def test_running_units_never_changes_the_recorded_values() -> None:
    runners = _runners(Residual(), (torch.randn(4, 6), torch.tensor([0, 1, 2])))
    recorded = {
        id(v): (v, v.clone())
        for r in runners
        for v in r.input_values.values()
        if isinstance(v, torch.Tensor)
    }
    assert any(not v.is_floating_point() for v, _ in recorded.values())
    for runner in runners:
        count_unit(runner)
        measure_ms(runner, "cpu", warmup=0, repeats=1)
    for value, before in recorded.values():
        assert torch.equal(value, before)


def test_fresh_inputs_are_new_storage_and_gradients_reach_the_leaves() -> None:
    runner = next(
        r
        for r in _runners(Residual(), (torch.randn(4, 6), torch.tensor([0, 1, 2])))
        if any(n.op == "call_module" and n.target == "relu" for n in r.nodes)
    )
    inputs = runner.fresh_inputs()
    recorded = [v for v in runner.input_values.values() if isinstance(v, torch.Tensor)]
    args = [a for a in inputs.args if isinstance(a, torch.Tensor)]
    assert {a.untyped_storage().data_ptr() for a in args}.isdisjoint(
        {v.untyped_storage().data_ptr() for v in recorded}
    )
    assert all(not a.is_leaf for a in args if a.requires_grad)  # in-place ops on them are allowed
    outputs = runner.run(inputs)
    assert runner.backward(outputs, inputs.leaves)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("stages", [2, 4])
def test_resnet_blocks_with_in_place_ops_partition_and_match(
    tmp_path: Path, frontend: str, stages: int
) -> None:
    traced, source = partition_file(
        MODELS / "inplace_resnet.py", stages, tmp_path / "build", frontend=frontend
    )
    assert traced.frontend == frontend
    assert_pipeline_matches(tmp_path / "build", source, training=True)
    if (
        frontend == "symbolic"
    ):  # the export graph bakes BatchNorm's train mode in (issue 10, item 5)
        assert_pipeline_matches(tmp_path / "build", source, training=False)
