"""Inputs that are containers of tensors (Note [tensors inside containers] in ``fxpipe.model_inputs``):
a model taking a dict batch, a list of tensors or a dataclass is partitioned, and the chained stages
equal the original in one process, in train and in eval mode (outputs, every gradient, every
buffer); a later call binds by the same structure, and another structure or constant is refused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from codegen_support import (
    assert_same_outputs_and_grads,
    build_model_file,
    reference_with_build_weights,
)
from fxpipe.codegen import load_pipeline, verify_build
from fxpipe.errors import CallError

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"

LIST_MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn as nn


    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 8)
            self.b = nn.Linear(4, 8)
            self.norm = nn.BatchNorm1d(8)
            self.out = nn.Linear(8, 3)

        def forward(self, xs, scale=1.0):
            h = torch.relu(self.norm(self.a(xs[0]) + self.b(xs[1])))
            return [self.out(h) * scale, (h.sum(-1),)]


    def build_model():
        torch.manual_seed(0)
        return Mixer()


    def example_inputs(batch_size):
        g = torch.Generator().manual_seed(batch_size)
        return ([torch.randn(batch_size, 6, generator=g), torch.randn(batch_size, 4, generator=g)],)
    """
)


@pytest.fixture(scope="module")
def list_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    folder = tmp_path_factory.mktemp("tree")
    path = folder / "list_model.py"
    path.write_text(LIST_MODEL)
    manifest, source = build_model_file(folder / "build", path, 2)
    return folder / "build", manifest, source


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_list_of_tensors_partitions_and_equals_the_original(
    list_build: tuple[Path, object, object], training: bool
) -> None:
    build, manifest, source = list_build
    assert manifest.call_spec.inputs == ("xs_0", "xs_1")  # type: ignore[attr-defined]
    reference = reference_with_build_weights(source, manifest, build).train(training)  # type: ignore[arg-type]
    pipeline = load_pipeline(build).train(training)
    g = torch.Generator().manual_seed(7)
    inputs = ([torch.randn(6, 6, generator=g), torch.randn(6, 4, generator=g)],)
    assert_same_outputs_and_grads(reference, pipeline, inputs)
    got = pipeline(*inputs)
    assert isinstance(got, list) and isinstance(got[1], tuple)
    assert verify_build(build).ok


def test_a_later_call_must_have_the_traced_structure(
    list_build: tuple[Path, object, object],
) -> None:
    build, _, _ = list_build
    pipeline = load_pipeline(build).eval()
    x, y = torch.randn(2, 6), torch.randn(2, 4)
    torch.testing.assert_close(pipeline((x, y))[0], pipeline([x, y])[0])  # a tuple for a list
    torch.testing.assert_close(pipeline(xs=[x, y])[0], pipeline([x, y])[0])
    with pytest.raises(CallError, match=r"xs holds xs\[0\], xs\[1\] in the traced call"):
        pipeline([x])
    with pytest.raises(CallError, match="scale=2.0 differs"):
        pipeline([x, y], scale=2.0)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
@pytest.mark.parametrize("name", ["dict_batch", "dataclass_batch"])
def test_a_dict_and_a_dataclass_batch_equal_the_original(
    tmp_path: Path, name: str, frontend: str
) -> None:
    """On both front ends: FX takes the container with a placeholder per leaf (Note [containers
    through FX] in fxpipe.tracer.frontend.symbolic), torch.export flattens it itself."""
    manifest, source = build_model_file(
        tmp_path / "build", ZOO / f"{name}.py", 2, frontend=frontend
    )
    assert manifest.frontend == frontend
    inputs = manifest.call_spec.inputs  # type: ignore[attr-defined]
    assert [t.name for t in manifest.inputs] == list(inputs) and len(inputs) > 1
    reference = reference_with_build_weights(source, manifest, tmp_path / "build")
    pipeline = load_pipeline(tmp_path / "build")
    for training in (True, False):
        reference.train(training)
        pipeline.train(training)
        for p in [*reference.parameters(), *pipeline.parameters()]:
            p.grad = None
        assert_same_outputs_and_grads(reference, pipeline, source.example_inputs(6))
    if name == "dict_batch":
        batch = source.example_inputs(2)[0]
        with pytest.raises(CallError, match=r"batch\['temperature'\]=1.0 differs"):
            pipeline(dict(batch, temperature=1.0))


MODEL_OUTPUT_MODEL = textwrap.dedent(
    '''
    import torch
    import torch.nn as nn
    from transformers.modeling_outputs import BaseModelOutputWithPooling


    class Head(nn.Module):
        """A head over an encoder's output, given as the encoder returned it."""

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.out = nn.Linear(8, 5)

        def forward(self, encoded, mask=None):
            h = torch.tanh(self.proj(encoded.last_hidden_state)) * mask[..., None]
            return self.out(h.sum(1) + encoded.pooler_output)


    def build_model():
        torch.manual_seed(0)
        return Head()


    def example_inputs(batch_size):
        g = torch.Generator().manual_seed(batch_size)
        encoded = BaseModelOutputWithPooling(
            last_hidden_state=torch.randn(batch_size, 4, 8, generator=g),
            pooler_output=torch.randn(batch_size, 8, generator=g),
        )
        return (encoded,), {"mask": torch.ones(batch_size, 4)}
    '''
)


def test_a_model_output_argument_partitions_and_equals_the_original(tmp_path: Path) -> None:
    path = tmp_path / "head.py"
    path.write_text(MODEL_OUTPUT_MODEL)
    manifest, source = build_model_file(tmp_path / "build", path, 2)
    assert manifest.call_spec.inputs == (
        "encoded_last_hidden_state",
        "encoded_pooler_output",
        "mask",
    )
    assert verify_build(tmp_path / "build").ok
