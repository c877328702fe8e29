"""A container that a stage holds whole, running identical blocks in order, is built as itself.

torchvision's ``layer1 = nn.Sequential(BasicBlock(...), BasicBlock(...))``: the generated class for
``layer1`` used to replace its own two block calls by a call of itself (``self(x)``) and fill itself
like a ModuleDict (``self["0"] = ...``), which fails when the stage is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from codegen_support import assert_same_outputs_and_grads

from fxpipe.codegen import emit_build, load_pipeline
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model_file

MODEL = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Blocks(nn.Module):  # a container of its own, looping over its children
    def __init__(self, width, n):
        super().__init__()
        self.items = nn.ModuleList(Block(width) for _ in range(n))

    def forward(self, x):
        for block in self.items:
            x = block(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.layer1 = nn.Sequential(Block(8), Block(8))
        self.layer2 = Blocks(8, 3)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(1)),)
"""


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_sequential_and_custom_containers_of_identical_blocks(
    tmp_path: Path, frontend: str
) -> None:
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    source = load_model_file(path)
    traced = trace_model_file(source, 2, frontend=frontend, progress=False)
    emit_build(
        traced.graph_module,
        traced.model,
        {n: 0 for n in traced.unit_of_node},
        1,
        tmp_path / "build",
        source=source,
        microbatch=2,
        batch_size=2,
        microbatches=1,
        output_spec=traced.output_spec,
    )
    text = (tmp_path / "build" / "stage_0.py").read_text()
    assert "self.layer1 = torch.nn.Sequential(Block(), Block())" in text, text
    assert "self(" not in text and 'self["0"]' not in text, text
    assert_same_outputs_and_grads(
        source.build_model(), load_pipeline(tmp_path / "build"), source.example_inputs(3)
    )
