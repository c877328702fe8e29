"""Stage files import the module that registers each custom operator they call (fxpipe.codegen.render.custom_ops).

A fresh worker imports only the stage file: an op registered by some other module's import
(transformers' ``grouped_mm_fallback``, an op a model file defines) must be registered by the
stage's own imports, or the worker fails with ``'_OpNamespace' ... has no attribute``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxpipe.codegen.render.custom_ops import import_for, registering_module
from fxpipe.codegen.render.pyrender import ImportTable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "tracer"))
from pipeline_support import MODELS, assert_pipeline_matches, partition_file  # noqa: E402

STYLES = {  # module name -> source registering fxpipe_reg::<name>
    "reg_custom_op": """
        import torch

        @torch.library.custom_op("fxpipe_reg::with_custom_op", mutates_args=())
        def with_custom_op(x: torch.Tensor) -> torch.Tensor:
            return x * 2
        """,
    "reg_library": """
        import torch

        lib = torch.library.Library("fxpipe_reg_lib", "DEF")
        lib.define("with_library(Tensor x) -> Tensor")
        lib.impl("with_library", lambda x: x * 2, "CompositeExplicitAutograd")
        """,
    "reg_define_fake": """
        import torch

        torch.library.define("fxpipe_reg::with_define", "(Tensor x) -> Tensor")

        @torch.library.impl("fxpipe_reg::with_define", "CompositeExplicitAutograd")
        def _impl(x):
            return x * 2

        @torch.library.register_fake("fxpipe_reg::with_define")
        def _fake(x):
            return torch.empty_like(x)
        """,
}


@pytest.fixture(scope="module")
def registering_modules(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("ops")
    for name, source in STYLES.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(folder))
    for name in STYLES:
        importlib.import_module(name)


@pytest.mark.parametrize(
    "op,module",
    [
        ("fxpipe_reg.with_custom_op.default", "reg_custom_op"),
        ("fxpipe_reg_lib.with_library.default", "reg_library"),
        ("fxpipe_reg.with_define.default", "reg_define_fake"),
    ],
)
def test_the_registering_module_is_found(registering_modules: None, op: str, module: str) -> None:
    namespace, name, overload = op.split(".")
    overload_op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    assert import_for(overload_op) == module
    assert import_for(getattr(getattr(torch.ops, namespace), name)) == module  # the packet too
    imports = ImportTable()
    assert imports.op(overload_op) == f"torch.ops.{op}"
    assert f"import {module}" in imports.lines()


def test_torch_operators_need_no_import() -> None:
    imports = ImportTable()
    assert imports.op(torch.ops.aten.add.Tensor) == "torch.ops.aten.add.Tensor"
    assert (
        imports.op(torch.ops.higher_order.wrap_with_set_grad_enabled)
        == "torch.ops.higher_order.wrap_with_set_grad_enabled"
    )
    assert import_for(torch.ops.aten.add.Tensor) is None
    assert registering_module("fxpipe_nowhere::op") is None
    assert imports.lines() == ["import torch"]


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_a_fresh_process_runs_stages_that_call_a_model_files_op(
    tmp_path: Path, frontend: str
) -> None:
    build = tmp_path / "build"
    traced, source = partition_file(MODELS / "custom_op.py", 2, build, frontend=frontend)
    assert traced.frontend == frontend
    for stage in sorted(build.glob("stage_*.py")):
        text = stage.read_text()
        assert "torch.ops.fxpipe_test.scaled_tanh" in text and "import_model_module(" in text, text
    assert_pipeline_matches(build, source, training=True)
    expected = load_and_run(build)
    script = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"from test_custom_ops import load_and_run; torch.save(load_and_run({str(build)!r}), sys.argv[1])"
    )
    out = tmp_path / "out.pt"
    subprocess.run(
        [sys.executable, "-c", script, str(out)],
        check=True,
        cwd=ROOT,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    torch.testing.assert_close(torch.load(out), expected)


def load_and_run(build: str | Path) -> torch.Tensor:
    """The chained stages of ``build`` on a fixed input (run in a fresh process by the test above)."""
    import fxpipe

    pipeline = fxpipe.load_pipeline(build)
    return pipeline(torch.randn(3, 8, generator=torch.Generator().manual_seed(5))).detach()
