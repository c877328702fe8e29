"""A build directory and its model file move together: another checkout, another node."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from fxpipe.codegen import Manifest, load_pipeline, verify_build, write_build_dir
from fxpipe.codegen.manifest import model_file_reference
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

ROOT = Path(__file__).resolve().parents[2]


def test_model_file_is_named_relative_to_the_build_inside_a_project(tmp_path: Path) -> None:
    (tmp_path / "proj" / "build" / "gpt").mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text("")
    assert (
        model_file_reference(tmp_path / "proj/examples/gpt.py", tmp_path / "proj/build/gpt")
        == "../../examples/gpt.py"
    )
    # outside any project (or outside the build's project) the build may move on its own: absolute
    (tmp_path / "loose" / "build").mkdir(parents=True)
    model = str((tmp_path / "loose/gpt.py").resolve())
    assert model_file_reference(model, tmp_path / "loose/build") == model
    assert model_file_reference(tmp_path / "elsewhere/gpt.py", tmp_path / "proj/build/gpt") == str(
        (tmp_path / "elsewhere/gpt.py").resolve()
    )


def test_a_moved_checkout_still_loads_and_verifies(tmp_path: Path) -> None:
    first, second = tmp_path / "checkout_a", tmp_path / "checkout_b"
    (first / "examples").mkdir(parents=True)
    (first / ".git").mkdir()  # a checkout
    shutil.copy(
        ROOT / "examples" / "gpt.py", first / "examples" / "gpt.py"
    )  # user leaf: imports the model file
    source = load_model_file(first / "examples" / "gpt.py")
    traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    write_build_dir(traced, plan, first / "build", source, batch_size=4, microbatches=2)
    assert Manifest.from_json(first / "build").model_file == "../examples/gpt.py"

    shutil.copytree(first, second)
    shutil.rmtree(first)  # nothing may still point at the old place
    report = verify_build(second / "build")
    assert report.ok, report.summary()
    pipeline = load_pipeline(second / "build")
    leaves = [m for m in pipeline.modules() if type(m).__name__ == "CausalSelfAttention"]
    assert leaves, "the GPT example's attention is a user leaf imported from the model file"
    for leaf in leaves:
        assert Path(sys.modules[type(leaf).__module__].__file__).is_relative_to(second)


def test_an_edited_model_file_is_refused_before_a_stage_imports_it(tmp_path: Path) -> None:
    import pytest

    from fxpipe.codegen import load_stage
    from fxpipe.errors import BuildDirError

    project = tmp_path / "project"
    (project / "examples").mkdir(parents=True)
    (project / "pyproject.toml").write_text("")
    model_file = project / "examples" / "gpt.py"
    shutil.copy(ROOT / "examples" / "gpt.py", model_file)
    source = load_model_file(model_file)
    traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    manifest = write_build_dir(
        traced, plan, project / "build", source, batch_size=4, microbatches=2
    )
    importing = [s.index for s in manifest.stages if s.imports_model_file]
    assert importing, "the GPT example's attention leaf is imported from the model file"

    marker = tmp_path / "ran"
    model_file.write_text(model_file.read_text() + f"\nopen({str(marker)!r}, 'w').close()\n")
    for index in importing:
        with pytest.raises(
            BuildDirError, match=r"model file gpt.py has sha256 .* changed after it was built"
        ):
            load_stage(project / "build", index)
    assert not marker.exists()
