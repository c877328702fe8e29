"""Modules of one class built at different sizes share one generated class that takes the sizes
(Note [classes that differ in their sizes] in fxpipe.codegen.render.variants).

transformers' GPT-2 builds ``Conv1D(nf, nx)`` at four sizes per block; the emitter wrote
``Conv1D``, ``Conv1D_2``, ``Conv1D_3`` and ``Conv1D_4``. ``Proj`` here is such a class (its
sizes kept as ``self.nin``/``self.nout``, read by ``view``), traced through torch.export.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxpipe.codegen import load_pipeline, write_build_dir
from fxpipe.codegen.check.equivalence import compare_in_mode
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model


class Proj(nn.Module):
    def __init__(self, nout: int, nin: int) -> None:
        super().__init__()
        self.nout = nout
        self.nin = nin
        self.weight = nn.Parameter(torch.randn(nin, nout) / nin**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.reshape(-1, self.nin) @ self.weight
        return out.view(*x.shape[:-1], self.nout).relu()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Proj(24, 8)  # first: no two sizes equal, so each number is read from one
        self.b = Proj(24, 24)
        self.c = Proj(16, 24)
        self.d = Proj(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


def _build(tmp_path: Path, stages: int) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    model = Net()
    traced = trace_model(model, (torch.randn(2, 5, 8),), frontend="export", progress=False)
    plan = plan_partition(traced.profile, stages, solver="uniform", microbatches=1)
    manifest = write_build_dir(traced, plan, tmp_path, None, batch_size=2, microbatches=1)
    files = [s.source for s in manifest.stages] + (
        [manifest.shared_source] if manifest.shared_source else []
    )
    return model, "\n".join((tmp_path / f).read_text() for f in files)


@pytest.mark.parametrize("stages", [1, 2])
def test_one_class_takes_the_sizes_and_the_stages_equal_the_model(
    tmp_path: Path, stages: int
) -> None:
    model, text = _build(tmp_path, stages)
    assert re.findall(r"^class (Proj\w*)\(", text, re.M) == ["Proj"], text
    assert "def __init__(self, nout: int, nin: int) -> None:" in text
    assert "self.weight = torch.nn.Parameter(torch.empty(nin, nout))" in text
    for ctor in ("Proj(nout=24, nin=8)", "Proj(nout=24, nin=24)", "Proj(nout=8, nin=16)"):
        assert ctor in text
    pipe = load_pipeline(tmp_path)
    x = torch.randn(3, 5, 8)
    for training in (True, False):
        result = compare_in_mode(model, pipe, list(pipe.stages), lambda m: m(x), training=training)
        assert result.ok, (training, result.worst)
