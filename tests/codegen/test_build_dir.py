"""The build directory is written whole or not at all (Note [build directory swap])."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from fxpipe.cli import main
from fxpipe.codegen import build as codegen_build
from fxpipe.codegen import check_build_target, write_build_dir
from fxpipe.errors import BuildDirError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

MLP = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"


@pytest.fixture(scope="module")
def traced() -> tuple[Any, Any]:
    source = load_model_file(MLP)
    return source, trace_model_file(source, 2, progress=False)


def _write(traced: tuple[Any, Any], out: Path, stages: int) -> Any:
    source, tr = traced
    plan = plan_partition(tr.profile, stages, solver="uniform", microbatches=2)
    return write_build_dir(tr, plan, out, source, batch_size=4, microbatches=2)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_one_writer_writes_every_file_of_the_build(traced: Any, tmp_path: Path) -> None:
    manifest = _write(traced, tmp_path / "build", 2)
    names = sorted(p.name for p in (tmp_path / "build").iterdir())
    assert names == [
        "manifest.json",
        "plan.json",
        "profile.json",
        "report.html",
        "stage_0.py",
        "stage_0.safetensors",
        "stage_1.py",
        "stage_1.safetensors",
        "tp_plan.json",
    ]
    assert manifest.num_stages == 2
    assert os.listdir(tmp_path) == ["build"]  # no temporary sibling left


def test_a_smaller_build_leaves_no_stale_stage_files(traced: Any, tmp_path: Path) -> None:
    out = tmp_path / "build"
    _write(traced, out, 4)
    (out / "run.json").write_text("{}")  # written by `fxpipe run`: part of the old build
    assert (out / "stage_3.py").is_file()
    _write(traced, out, 2)
    assert not (out / "stage_3.py").exists() and not (out / "stage_2.safetensors").exists()
    assert not (out / "run.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["build"]


def test_a_failed_partition_leaves_the_previous_build_byte_identical(
    traced: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "build"
    _write(traced, out, 2)
    before = _snapshot(out)
    save = codegen_build.save_weights

    def failing_save(state: Any, path: Path) -> None:
        if (
            path.name == "stage_2.safetensors"
        ):  # stages 0 and 1 (and stage 2's source) are written by then
            raise RuntimeError("injected failure in emit")
        save(state, path)

    monkeypatch.setattr(codegen_build, "save_weights", failing_save)
    with pytest.raises(RuntimeError, match="injected"):
        _write(traced, out, 4)
    assert _snapshot(out) == before
    assert os.listdir(tmp_path) == ["build"]


def test_a_full_disk_is_one_error_and_keeps_the_previous_build(
    traced: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "build"
    _write(traced, out, 2)
    before = _snapshot(out)

    def full(state: Any, path: Path) -> None:
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(codegen_build, "save_weights", full)
    with pytest.raises(
        BuildDirError, match="No space left on device.*previous build|previous build.*No space"
    ):
        _write(traced, out, 2)
    assert _snapshot(out) == before
    assert os.listdir(tmp_path) == ["build"]


def test_out_that_is_a_file_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "build"
    target.write_text("not a directory")
    code = main(["partition", str(MLP), "--stages", "2", "--out", str(target)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and "is a file" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert target.read_text() == "not a directory"


def test_out_below_a_file_and_foreign_folders_are_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BuildDirError, match="not a directory"):
        check_build_target(tmp_path / "notes.txt" / "build")
    with pytest.raises(BuildDirError, match=r"not part of an fxpipe build \(notes\.txt\)"):
        check_build_target(tmp_path)  # `--out .` must never replace a folder of the user's files
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders"
)
def test_read_only_parent_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(BuildDirError, match="not writable"):
            check_build_target(parent / "build")
    finally:
        parent.chmod(0o755)


def test_a_class_two_stages_use_is_written_once_in_shared_py(tmp_path: Path) -> None:
    """Note [classes several stages share]: shared.py is a file of the build, hashed in the manifest, imported by
    the stages that use it; each stage still loads alone."""
    import hashlib

    from fxpipe.codegen import load_stage

    source = load_model_file(MLP.parent / "gpt.py")
    traced = trace_model_file(source, 2, frontend="export", progress=False)
    plan = plan_partition(traced.profile, 2, solver="uniform", microbatches=2)
    out = tmp_path / "build"
    manifest = write_build_dir(traced, plan, out, source, batch_size=4, microbatches=2)
    assert "shared.py" in os.listdir(out) and manifest.shared_source == "shared.py"
    assert manifest.shared_sha256 == hashlib.sha256((out / "shared.py").read_bytes()).hexdigest()
    assert all(sm.imports_shared for sm in manifest.stages)
    shared = (out / "shared.py").read_text()
    assert shared.count("class Block(") == 1
    assert not any("class Block(" in (out / sm.source).read_text() for sm in manifest.stages)
    stage = load_stage(out, 1)
    block = next(m for m in stage.modules() if type(m).__name__ == "Block")
    assert type(block).__module__.startswith("fxpipe_shared_")
    # a build held in memory (the seed API's ranks) checks and imports it from its bytes too
    from fxpipe.codegen import CheckedBuild
    from fxpipe.codegen.load import load_checked_stage

    files = {
        name: (out / name).read_bytes()
        for name in ("manifest.json", "plan.json", "shared.py", "stage_1.py", "stage_1.safetensors")
    }
    assert (
        load_checked_stage(CheckedBuild.from_memory(files, [1], tmp_path / "elsewhere"), 1)
        is not None
    )
    with pytest.raises(BuildDirError, match="shared classes shared.py is missing from the build"):
        CheckedBuild.from_memory(
            {k: v for k, v in files.items() if k != "shared.py"}, [1], tmp_path / "elsewhere"
        )


@pytest.mark.parametrize("manifest", [None, "{not json", '{"schema_version": 1}'])
def test_a_folder_of_build_file_names_without_a_readable_manifest_is_refused(
    manifest: str | None, tmp_path: Path
) -> None:
    """A user's report.html and profile.json (names a build also holds) are never replaced (#35 item 10)."""
    (tmp_path / "report.html").write_text("<p>my report</p>")
    (tmp_path / "profile.json").write_text("{}")
    if manifest is not None:
        (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(BuildDirError, match="not a build fxpipe wrote"):
        check_build_target(tmp_path)
    assert (tmp_path / "report.html").read_text() == "<p>my report</p>"


def test_an_empty_folder_and_a_build_may_be_replaced(traced: Any, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert check_build_target(tmp_path / "empty") == tmp_path / "empty"
    _write(traced, tmp_path / "build", 2)
    assert check_build_target(tmp_path / "build") == tmp_path / "build"


def test_every_file_of_a_build_has_the_same_mode(traced: Any, tmp_path: Path) -> None:
    """The weights too (safetensors writes 0600): another user who can read the sources can load the build."""
    _write(traced, tmp_path / "build", 2)
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "build").iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, modes
