"""Splitting rules on hand-made graphs: sizes crossing stages, plan errors, export specifics."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from codegen_support import assert_same_outputs_and_grads
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._pytree import tree_flatten

from fxpipe.codegen import emit_build, load_pipeline, split_graph, verify_build
from fxpipe.errors import CodegenError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.codegen import write_build_dir
from fxpipe.tracer import TensorSpec, trace_model_file


def _specs(gm: fx.GraphModule, x: torch.Tensor) -> dict[str, object]:
    ShapeProp(gm).propagate(x)
    return {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}


def annotate(gm: fx.GraphModule, batch: int, features: int) -> fx.GraphModule:
    """Fill ``fxpipe_spec`` / ``fxpipe_path`` as the tracer would; the batch dim is found by running two batch sizes."""
    a = _specs(gm, torch.randn(batch, features))
    b = _specs(gm, torch.randn(batch + 1, features))
    for n in gm.graph.nodes:
        meta = a[n.name]
        n.meta["fxpipe_path"] = str(n.target) if n.op == "call_module" else ""
        if hasattr(meta, "shape"):
            dims = [i for i, (p, q) in enumerate(zip(meta.shape, b[n.name].shape)) if p != q]
            n.meta["fxpipe_spec"] = TensorSpec(
                tuple(meta.shape),
                str(meta.dtype).removeprefix("torch."),
                dims[0] if dims else None,
                meta.requires_grad,
            )
        else:
            n.meta["fxpipe_spec"] = None
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if isinstance(out.args[0], fx.Node):
        out.args = ((out.args[0],),)  # the normalized graph returns a flat tuple
    gm.recompile()
    return gm


SINGLE_TENSOR = tree_flatten(torch.zeros(1))[1]


class SizesAcross(nn.Module):
    """Sizes read in stage 0 are used in stages 1 and 2 (batch dims, a static dim, a doubled batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        n = h.size(0)  # batch size of an activation stage 2 never sees
        k = h.size(1)  # a static dim
        m = h.repeat(2, 1).size(0)  # 2 * batch: no tensor of stage 2 has that size
        g = self.b(h)
        y = self.c(g).view(n, 2, k // 2)
        return y * m


def _stage_map(gm: fx.GraphModule, later: dict[str, int]) -> dict[str, int]:
    stages, current = {}, 0
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            current = max(current, later.get(n.name, current))
            stages[n.name] = current
    return stages


def test_sizes_are_recomputed_or_sent_as_0d_tensors(tmp_path: Path) -> None:
    model = SizesAcross()
    gm = annotate(fx.symbolic_trace(model), 4, 8)
    stage_of = _stage_map(gm, {"b": 1, "c": 2})
    manifest = emit_build(
        gm,
        model,
        stage_of,
        3,
        tmp_path,
        source=None,
        microbatch=4,
        batch_size=4,
        microbatches=1,
        output_spec=SINGLE_TENSOR,
    )
    last = (tmp_path / "stage_2.py").read_text()
    assert (
        "size = x.size(0)" in last
    )  # n: read again from a tensor this stage has (the model input)
    assert "8 // 2" in last  # k: a static dim becomes a literal
    boundary = {t.name: t for t in manifest.stages[2].inputs}
    sent = [t for t in boundary.values() if t.name.endswith("_tensor")]
    assert (
        "repeat" not in boundary
        and len(sent) == 1
        and sent[0].dtype == "int64"
        and sent[0].shape == ()
    )  # m: sent as a 0-d tensor
    pipeline = load_pipeline(tmp_path)
    x = torch.randn(7, 8)  # another batch size than traced
    assert_same_outputs_and_grads(model, pipeline, (x,))


def test_plan_that_sends_backwards_is_refused() -> None:
    model = SizesAcross()
    gm = annotate(fx.symbolic_trace(model), 4, 8)
    stage_of = _stage_map(gm, {"b": 1})
    stage_of["a"] = 1
    stage_of["b"] = 0
    with pytest.raises(CodegenError, match="dependency order"):
        split_graph(gm, stage_of, 2)
    del stage_of["a"]
    with pytest.raises(CodegenError, match="'a'.*has no stage"):
        split_graph(gm, stage_of, 2)


EXPORT_MODEL = '''
import torch
import torch.nn as nn


class Odd(nn.Module):
    """no_grad region, arange on the input's device, a constant, a non-persistent buffer, BatchNorm."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            shift = x.mean(dim=1, keepdim=True) * 2
        h = self.bn(self.a(x + shift))
        pos = torch.arange(x.size(0), device=x.device).float().unsqueeze(1)
        return self.b(h * self.scale) + pos * torch.tensor(0.25)


def build_model():
    return Odd()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8, generator=g),)
'''


def test_export_graph_with_no_grad_constants_and_devices(tmp_path: Path) -> None:
    path = tmp_path / "odd_model.py"
    path.write_text(textwrap.dedent(EXPORT_MODEL))
    source = load_model_file(path)
    traced = trace_model_file(source, 2, frontend="export", progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    manifest = write_build_dir(
        traced, plan, tmp_path / "build", source, batch_size=4, microbatches=2
    )
    text = "".join((tmp_path / "build" / sm.source).read_text() for sm in manifest.stages)
    assert "wrap_with_set_grad_enabled" in text and "device(type=" not in text
    assert "scale" in {k.rpartition(".")[2] for sm in manifest.stages for k in sm.constants}
    report = verify_build(tmp_path / "build")
    assert report.ok, report.summary()
    pipeline = load_pipeline(tmp_path / "build")
    for stage in pipeline.stages:
        assert "scale" not in stage.state_dict()
