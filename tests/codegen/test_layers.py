"""A traced ``torch.nn`` layer call becomes the layer itself only when it is exactly that layer's forward.

Each layer is exported inside a small model; the stage must build ``torch.nn.<Layer>(...)``
and call it where the layer's traced body matches (fxpipe.codegen.render.layers), keep the traced
body where it does not, and compute what the original computes either way.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from codegen_support import assert_same_outputs_and_grads

from fxpipe.codegen import emit_build, load_pipeline
from fxpipe.codegen.render.layers import TORCH_LAYERS
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.tracer import trace_model_file

MODEL = """
import torch
import torch.nn as nn


class Wrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = {layer}
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.layer(x) * self.scale


def build_model():
    torch.manual_seed(0)
    return Wrap()


def example_inputs(batch_size):
    g = torch.Generator().manual_seed(1)
    return ({inputs},)
"""
FLOAT = "torch.randn(batch_size, 3, generator=g)"
SEQ = "torch.randn(batch_size, 3, 8, generator=g)"
IMAGE = "torch.randn(batch_size, 3, 6, 6, generator=g)"
TOKENS = "torch.randint(0, 10, (batch_size, 5), generator=g)"
CASES = [  # layer, inputs, written as the layer itself
    ("nn.Linear(3, 4)", FLOAT, True),
    ("nn.Linear(3, 4, bias=False)", FLOAT, True),
    ("nn.LayerNorm(3)", FLOAT, True),
    ("nn.LayerNorm(3, eps=1e-3, elementwise_affine=False)", FLOAT, True),
    ("nn.LayerNorm([3, 8], bias=False)", SEQ, True),
    ("nn.Embedding(10, 4)", TOKENS, True),
    ("nn.Embedding(10, 4, padding_idx=2)", TOKENS, True),
    ("nn.Embedding(10, 4, max_norm=1.0)", TOKENS, False),  # renormalises its weight first
    ("nn.Conv1d(3, 4, 3, stride=2, padding=1)", SEQ, True),
    ("nn.Conv2d(3, 6, 3, padding=1, dilation=2, groups=3, bias=False)", IMAGE, True),
    ("nn.Conv2d(3, 4, 3, padding='same')", IMAGE, False),  # another conv2d overload
    ("nn.Conv2d(3, 4, 3, padding=1, padding_mode='reflect')", IMAGE, False),
    ("nn.GELU()", FLOAT, True),
    ("nn.GELU(approximate='tanh')", FLOAT, True),
    ("nn.ReLU()", FLOAT, True),
    ("nn.Tanh()", FLOAT, True),
    ("nn.Sigmoid()", FLOAT, True),
    ("nn.SiLU()", FLOAT, True),
    ("nn.Dropout(0.0)", FLOAT, False),  # its training flag is baked in by export
]


def _one_stage(tmp_path: Path, model_source: str) -> tuple[ModelSource, str]:
    """Export the model file ``model_source`` and emit it as one stage into ``tmp_path / "build"``."""
    path = tmp_path / "model.py"
    path.write_text(model_source)
    source = load_model_file(path)
    traced = trace_model_file(source, 2, frontend="export", progress=False)
    stage_of = {n: 0 for n in traced.unit_of_node}
    emit_build(
        traced.graph_module,
        traced.model,
        stage_of,
        1,
        tmp_path / "build",
        source=source,
        microbatch=2,
        batch_size=2,
        microbatches=1,
        output_spec=traced.output_spec,
    )
    return source, (tmp_path / "build" / "stage_0.py").read_text()


def test_every_listed_layer_is_exercised() -> None:
    listed = {c.__name__ for c in TORCH_LAYERS}
    exercised = {
        layer.split("(")[0].removeprefix("nn.") for layer, _, replaced in CASES if replaced
    }
    assert listed == exercised


@pytest.mark.parametrize("layer,inputs,replaced", CASES)
def test_layer_written_as_itself_only_when_exact(
    tmp_path: Path, layer: str, inputs: str, replaced: bool
) -> None:
    source, text = _one_stage(tmp_path, textwrap.dedent(MODEL.format(layer=layer, inputs=inputs)))
    cls = layer.split("(")[0].removeprefix("nn.")
    assert (f"self.layer = torch.nn.{cls}(" in text) == replaced, text
    if replaced:
        assert "self.layer(x)" in text
    pipeline = load_pipeline(tmp_path / "build")
    assert_same_outputs_and_grads(source.build_model(), pipeline, source.example_inputs(3))


OTHER_CONFIGURATION = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Wrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 4)
        {change}

    def forward(self, x):
        return self.layer(x)


def build_model():
    torch.manual_seed(0)
    return Wrap()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, generator=torch.Generator().manual_seed(1)),)
"""


@pytest.mark.parametrize(
    "change",
    [
        "self.layer.register_forward_hook(lambda module, args, out: out * 3)",
        # an instance forward whose traced call is exactly nn.Linear's: the layer rebuilt without it is
        # still not the original module (Note [rebuilt modules equal the original])
        "self.layer.forward = lambda x: F.linear(x, self.layer.weight, self.layer.bias)",
    ],
)
def test_a_layer_with_other_configuration_keeps_its_traced_body(
    tmp_path: Path, change: str
) -> None:
    source, text = _one_stage(tmp_path, OTHER_CONFIGURATION.format(change=change))
    assert "torch.nn.Linear(" not in text and "F.linear(" in text, text
    assert_same_outputs_and_grads(
        source.build_model(), load_pipeline(tmp_path / "build"), source.example_inputs(3)
    )
