"""A model file edited within one Python process (a notebook): the next partition and every load run
the file as it is now, never a class imported from its old bytes (Note [what is hashed is what runs])."""

from __future__ import annotations

from pathlib import Path

import torch
from codegen_support import build_model_file

from fxpipe.codegen import load_pipeline, write_build_dir
from fxpipe.modelfile import import_model_module, load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

_SOURCE = """
import torch
import torch.nn as nn

SCALE = {scale}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * SCALE


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x):
        return self.b(self.a(x))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(1)),)
"""


def _fresh_output(path: Path, x: torch.Tensor) -> torch.Tensor:
    """What the file computes now, executed from its current text outside fxpipe's module cache."""
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - the test's own file
    with torch.no_grad():
        return namespace["build_model"]()(x)


def _build(out: Path, path: Path, check: bool = True) -> None:
    """A 2-stage build in which ``Block`` stays a leaf: each stage imports the class from the model file."""
    source = load_model_file(path)
    traced = trace_model_file(source, 2, leaves=["Block"], progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2, time_limit=5.0)
    write_build_dir(traced, plan, out, source, batch_size=4, microbatches=2, check=check)


def test_import_model_module_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(_SOURCE.format(scale=1.0))
    assert import_model_module(path).SCALE == 1.0
    path.write_text(_SOURCE.format(scale=5.0))
    assert import_model_module(path).SCALE == 5.0


def test_partition_edit_partition_loads_the_new_model(tmp_path: Path) -> None:
    path, out = tmp_path / "m.py", tmp_path / "b"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    path.write_text(_SOURCE.format(scale=1.0))
    _build(out, path)
    with torch.no_grad():
        torch.testing.assert_close(load_pipeline(out)(x), _fresh_output(path, x))
    path.write_text(
        _SOURCE.format(scale=5.0)
    )  # the stage sources stay byte-identical; the class changes
    _build(out, path)
    with torch.no_grad():
        torch.testing.assert_close(load_pipeline(out)(x), _fresh_output(path, x))


def test_a_cached_stage_module_is_not_reused_for_another_model_file(tmp_path: Path) -> None:
    """Without the safety net (``check=False``), the second load is the only place the old class could run."""
    path, out = tmp_path / "m.py", tmp_path / "b"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    path.write_text(_SOURCE.format(scale=1.0))
    _build(out, path, check=False)
    with torch.no_grad():
        load_pipeline(out)(x)
    path.write_text(_SOURCE.format(scale=5.0))
    _build(out, path, check=False)
    with torch.no_grad():
        torch.testing.assert_close(load_pipeline(out)(x), _fresh_output(path, x))


def test_stage_load_imports_the_checked_bytes_not_the_file(tmp_path: Path) -> None:
    """A build loads what its manifest hashed: the model module imported from the checked bytes, even if
    the stage file's own ``import_model_module(path)`` would re-read the file."""
    import fxpipe.modelfile as modelfile
    from fxpipe.codegen.integrity import check_build
    from fxpipe.codegen.load import load_checked_stage

    path, out = tmp_path / "m.py", tmp_path / "b"
    path.write_text(_SOURCE.format(scale=1.0))
    _build(out, path)
    build = check_build(out, [0], plan=False)
    reads: list[Path] = []
    original = Path.read_bytes

    def spy(self: Path) -> bytes:
        reads.append(self)
        return original(self)

    Path.read_bytes = spy  # type: ignore[method-assign]
    try:
        stage = load_checked_stage(build, 0)
    finally:
        Path.read_bytes = original  # type: ignore[method-assign]
    assert path.resolve() not in reads
    assert type(stage.a).__module__ == build.model_module().__name__
    assert not modelfile._pinned
