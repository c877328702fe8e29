"""Batch dimensions of the inputs: taken from the model file, given by the caller, or dim 0 by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxpipe.errors import ModelFileError, TraceError
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import trace_model, trace_model_file
from fxpipe.tracer.measure.shapes import double_batch, infer_batch_dims

# sequence-first activations [T, B, C] and a [T, T] mixing mask shared by every sample
SEQ_FIRST = """
import torch
import torch.nn as nn

T, C = 6, 8


class SeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(C, C)
        self.mix = nn.Linear(C, C)
        self.out = nn.Linear(C, C)

    def forward(self, x, mask):
        h = torch.relu(self.inp(x))
        h = torch.einsum("st,tbc->sbc", mask, h)
        return self.out(torch.relu(self.mix(h)))


def build_model():
    return SeqFirst()


def example_inputs(b):
    return torch.randn(T, b, C), torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1).unsqueeze(1)
"""


def _model_file(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_model_file_gives_sequence_first_and_shared_inputs(tmp_path: Path, frontend: str) -> None:
    source = load_model_file(_model_file(tmp_path, SEQ_FIRST))
    traced = trace_model_file(source, 4, frontend=frontend, progress=False)
    assert traced.frontend == frontend
    assert [(s.shape, s.batch_dim) for s in traced.profile.inputs] == [
        ((6, 4, 8), 1),
        ((6, 6), None),
    ]
    assert all(spec.batch_dim == 1 for unit in traced.profile.units for spec in unit.outputs)
    assert traced.profile.batch_size == 4
    for batch in (1, 3):
        inputs = source.example_inputs(batch)
        with torch.no_grad():
            (got,) = traced.graph_module(*inputs)
            torch.testing.assert_close(got, traced.model(*inputs))


def test_trace_model_takes_batch_dims_and_defaults_to_dim_0() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(5, 4, 8)
    given = trace_model(model, (x,), batch_dims=(1,), progress=False)
    assert given.profile.inputs[0].batch_dim == 1 and given.profile.batch_size == 4
    assert all(s.batch_dim == 1 for u in given.profile.units for s in u.outputs)
    default = trace_model(model, (x,), progress=False)
    assert default.profile.inputs[0].batch_dim == 0 and default.profile.batch_size == 5


@pytest.mark.parametrize(
    "batch_dims, fragment",
    [
        ((0, 1), "batch_dims has 2 entries but there are 1 inputs"),
        ((3,), "batch_dims[0] is 3 but input 0 has shape [5, 4, 8]"),
        ((None,), "no input has a batch dimension"),
    ],
)
def test_bad_batch_dims_name_the_problem(batch_dims: tuple[int | None, ...], fragment: str) -> None:
    with pytest.raises(TraceError, match=fragment.replace("[", r"\[")):
        trace_model(nn.Linear(8, 8), (torch.randn(5, 4, 8),), batch_dims=batch_dims, progress=False)


def test_infer_and_double_batch_along_the_batch_dims() -> None:
    first = (torch.zeros(6, 2, 3), torch.zeros(6, 6), torch.zeros(2, dtype=torch.long))
    second = (torch.zeros(6, 4, 3), torch.zeros(6, 6), torch.zeros(4, dtype=torch.long))
    dims = infer_batch_dims(first, second)
    assert dims == (1, None, 0)
    assert [t.shape for t in double_batch(first, dims)] == [t.shape for t in second]
    with pytest.raises(ValueError, match="exactly one dimension"):
        infer_batch_dims((torch.zeros(2, 3),), (torch.zeros(4, 6),))
    with pytest.raises(ValueError, match="float32"):
        infer_batch_dims((torch.zeros(2),), (torch.zeros(4, dtype=torch.long),))


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        ("torch.randn(3, 8),", "return the same shapes (float32[3, 8])"),
        ("torch.randn(b, 8 * b),", "exactly one dimension (the batch) may change"),
    ],
)
def test_model_file_whose_inputs_do_not_scale_with_the_batch(
    tmp_path: Path, inputs: str, fragment: str
) -> None:
    text = f"import torch\ndef build_model():\n    return torch.nn.Identity()\ndef example_inputs(b):\n    return ({inputs})\n"
    source = load_model_file(_model_file(tmp_path, text))
    with pytest.raises(
        ModelFileError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        trace_model_file(source, 2, progress=False)


def test_model_that_rejects_its_inputs_is_a_model_file_error() -> None:
    with pytest.raises(
        ModelFileError,
        match=r"Linear raised on its example inputs \(float32\[2, 5\]\): "
        r"RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    ):
        trace_model(nn.Linear(4, 4), (torch.randn(2, 5),), progress=False)
