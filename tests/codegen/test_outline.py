"""Module structure in emitted stages: one class per distinct block body, stacks of identical blocks,
boundary tensors named after their module, the module range in the docstring, and numerics
unchanged (both front ends, another batch size than traced)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from codegen_support import assert_same_outputs_and_grads

from fxpipe.codegen import Manifest, emit_build, load_pipeline, verify_build, write_build_dir
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file
from fxpipe.graphmeta import PATH_KEY

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, scale=1.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)
        self.scale = scale

    def forward(self, x):
        h = F.gelu(self.fc(self.norm(x)))
        return x + self.out(h) * self.scale


class Blocks(nn.Module):
    """Four identical blocks, then one of the same class with another constant."""

    def __init__(self, layers=4, width=8):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.odd = Block(width, scale=0.5)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.odd(h))


class Shared(nn.Module):
    """Tied weights inside and across blocks, and a block called twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(3))
        self.blocks[1].fc.weight = self.blocks[0].fc.weight
        self.again = Block(8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight  # read below as a tensor, not through the layer

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](self.again(h))
        return F.linear(h, self.out.weight)


def build_model():
    torch.manual_seed(0)
    return Blocks()


def build_shared():
    torch.manual_seed(0)
    return Shared()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, 4, generator=g),)


def token_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 10, (batch_size, 5), generator=g),)
'''
FRONTENDS = ["symbolic", "export"]


def _source(
    tmp_path: Path, model_fn: str = "build_model", inputs_fn: str = "example_inputs"
) -> ModelSource:
    path = tmp_path / "blocks_model.py"
    path.write_text(textwrap.dedent(MODEL))
    return load_model_file(path, model_fn=model_fn, inputs_fn=inputs_fn)


def _build_split_at(
    tmp_path: Path, frontend: str, first_of_stage_1: str
) -> tuple[Manifest, ModelSource, Path]:
    """Two stages: everything before the first node of module ``first_of_stage_1`` is stage 0."""
    source = _source(tmp_path)
    traced = trace_model_file(source, 2, frontend=frontend, progress=False)
    stage_of, stage = {}, 0
    for node in traced.graph_module.graph.nodes:
        if node.name in traced.unit_of_node:
            if str(node.meta.get(PATH_KEY, "")).startswith(first_of_stage_1):
                stage = 1
            stage_of[node.name] = stage
    out = tmp_path / "build"
    manifest = emit_build(
        traced.graph_module,
        traced.model,
        stage_of,
        2,
        out,
        source=source,
        microbatch=2,
        batch_size=2,
        microbatches=1,
        output_spec=traced.output_spec,
    )
    return manifest, source, out


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_identical_blocks_share_a_class_and_run_as_a_stack(tmp_path: Path, frontend: str) -> None:
    manifest, source, out = _build_split_at(tmp_path, frontend, "blocks.2")
    first, second = ((out / sm.source).read_text() for sm in manifest.stages)
    shared = (out / manifest.shared_source).read_text()  # Note [classes several stages share]
    assert (
        len(re.findall(r"^class Block\(", shared, re.M)) == 1
        and "class Block(" not in first + second
    )
    for text in (first, second, shared):
        assert "torch.ops.aten" not in text
    for text in (first, second):
        assert "Block = _shared.Block\n" in text and "BlockStack = _shared.BlockStack\n" in text
    assert "self.blocks = BlockStack({str(i): Block() for i in range(0, 2)})" in first
    assert "self.blocks = BlockStack({str(i): Block() for i in range(2, 4)})" in second
    assert (
        "class Block_2(" in second and "self.odd = Block_2()" in second
    )  # scale 0.5: not the same body
    assert "Modules: inp, blocks.0-1" in first and "Modules: blocks.2-3, odd, head" in second
    assert [t.name for t in manifest.stages[0].outputs] == ["blocks_1_out"]
    assert [t.name for t in manifest.stages[1].inputs] == ["blocks_1_out"]
    # export records the source's own names (Note [names from the source]): `h = self.inp(x)`
    assert (
        "blocks_1_out = self.blocks(inp)"
        if frontend == "symbolic"
        else "blocks_1_out = self.blocks(h)"
    ) in first
    pipeline = load_pipeline(out)
    assert_same_outputs_and_grads(source.build_model(), pipeline, source.example_inputs(3))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_block_split_across_stages_stays_flat_and_correct(tmp_path: Path, frontend: str) -> None:
    manifest, source, out = _build_split_at(tmp_path, frontend, "blocks.1.out")
    first, second = ((out / sm.source).read_text() for sm in manifest.stages)
    assert "Part of: blocks.1" in first and "Part of: blocks.1" in second
    assert 'self.blocks["1"].fc(' in first and 'self.blocks["1"].out(' in second
    # the block's input (for the residual) and the value inside it where the stages meet
    inner = (
        "blocks_1_gelu" if frontend == "symbolic" else "blocks_1_h"
    )  # export: what the source calls it
    assert [t.name for t in manifest.stages[0].outputs] == ["blocks_0_out", inner]
    pipeline = load_pipeline(out)
    assert_same_outputs_and_grads(source.build_model(), pipeline, source.example_inputs(5))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_blocks_beside_a_split_block_run_in_a_loop(tmp_path: Path, frontend: str) -> None:
    manifest, source, out = _build_split_at(tmp_path, frontend, "blocks.3.out")
    first = (out / manifest.stages[0].source).read_text()
    assert "self.blocks = torch.nn.ModuleDict({str(i): Block() for i in range(0, 3)})" in first
    assert (
        "for i in range(0, 3):\n            blocks_2_out = self.blocks[str(i)](blocks_2_out)"
        in first
    )
    assert 'self.blocks["3"].fc(' in first
    pipeline = load_pipeline(out)
    assert_same_outputs_and_grads(source.build_model(), pipeline, source.example_inputs(3))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_tied_and_reused_blocks_round_trip(tmp_path: Path, frontend: str, stages: int) -> None:
    source = _source(tmp_path, "build_shared", "token_inputs")
    traced = trace_model_file(source, 2, frontend=frontend, progress=False)
    plan = plan_partition(traced.profile, stages, solver="uniform", microbatches=2)
    out = tmp_path / "build"
    write_build_dir(traced, plan, out, source, batch_size=4, microbatches=2)
    assert verify_build(out).ok
    pipeline = load_pipeline(out)
    assert_same_outputs_and_grads(source.build_model(), pipeline, source.example_inputs(3))
    union: dict[str, torch.Tensor] = {}
    for stage in pipeline.stages:
        union.update(stage.state_dict())
    assert set(union) <= set(source.build_model().state_dict())
