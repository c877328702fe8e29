"""Bad files of each schema, beyond tests/test_artifact_schemas.py's field-by-field table: whole-file
damage (not text, empty, a FIFO), inconsistent content, and the files only a worker reads
(``--options``) and only a run writes into a build (the manifest's own fields).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fxpipe.cli import main


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    ), err
    return err


def _write_bytes(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def _edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return apply


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


WHOLE_FILE = {  # damage to any JSON artifact
    "not UTF-8": (_write_bytes(b"\xff\xfe\x00 garbage"), "is not UTF-8 text"),
    "empty": (_write_bytes(b""), "is not valid JSON"),
    "a FIFO": (_fifo, "is a FIFO, not a regular file"),
    "a JSON list": (_write_bytes(b"[1, 2]"), "must be a JSON object"),
}

PROFILE_CONTENT = {
    "no units": (_edit(lambda d: d.update(units=[])), "a profile needs at least one unit"),
    "duplicate unit names": (
        _edit(lambda d: d["units"][1].update(name=d["units"][0]["name"])),
        "duplicate unit name",
    ),
    "an edge that goes backwards": (
        _edit(
            lambda d: d["edges"].append(
                {"src": d["units"][3]["name"], "dst": d["units"][1]["name"], "bytes": 4}
            )
        ),
        "goes backwards",
    ),
    "batch_size true": (
        _edit(lambda d: d.update(batch_size=True)),
        "batch_size: expected an integer, got true",
    ),
}


@pytest.mark.parametrize("name", [*WHOLE_FILE, *PROFILE_CONTENT])
def test_bad_profile_files(
    name: str, mlp_project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damage, fragment = {**WHOLE_FILE, **PROFILE_CONTENT}[name]
    path = tmp_path / "profile.json"
    path.write_bytes((mlp_project / "build" / "profile.json").read_bytes())
    damage(path)
    assert fragment in _one_line(
        capsys, ["plan", str(path), "--stages", "2", "--out", str(tmp_path / "p.json")]
    )


PLAN_CONTENT = {
    "no stages": (_edit(lambda d: d.update(stages=[])), "plan"),
    "num_stages as text": (
        _edit(lambda d: d.update(num_stages="two")),
        "num_stages: expected an integer",
    ),
}


@pytest.mark.parametrize("name", [*WHOLE_FILE, *PLAN_CONTENT])
def test_bad_plan_files_in_report(
    name: str, mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damage, fragment = {**WHOLE_FILE, **PLAN_CONTENT}[name]
    damage(mlp_copy / "plan.json")
    assert fragment in _one_line(capsys, ["report", str(mlp_copy)])


MANIFEST_CONTENT = {
    "no stages": (_edit(lambda d: d.update(stages=[])), "lists no stages"),
    "plan_sha256 a number": (
        _edit(lambda d: d.update(plan_sha256=5)),
        "plan_sha256: expected a string, got 5",
    ),
    "weights outside the build": (
        _edit(lambda d: d["stages"][1].update(weights="/etc/passwd")),
        "is not a file name inside the build directory",
    ),
    "no model file": (_edit(lambda d: d.update(model_file="")), "model file"),
    "model file without its hash": (
        _edit(lambda d: d.update(model_sha256="")),
        "records no sha256",
    ),
}


@pytest.mark.parametrize("verb", ["verify", "run"])
@pytest.mark.parametrize("name", [*WHOLE_FILE, *MANIFEST_CONTENT])
def test_bad_manifest_files(
    name: str, verb: str, mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damage, fragment = {**WHOLE_FILE, **MANIFEST_CONTENT}[name]
    damage(mlp_copy / "manifest.json")
    assert fragment in _one_line(capsys, [verb, str(mlp_copy)])
    assert not (mlp_copy / "run.json").exists()


OPTIONS = {
    "a wrong type": (b'{"steps": "many"}', "steps"),
    "an unknown option": (b'{"stepz": 3}', "unknown run options ['stepz']"),
    "not JSON": (b"{steps", "is not valid JSON"),
    "a newer schema": (b'{"schema_version": 99}', "newer than this fxpipe understands"),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_bad_worker_options_file(
    name: str, mlp_copy: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ``--options`` file a worker reads (``fxpipe run`` writes it; a user's own torchrun may too)."""
    from fxpipe.runtime.launch import worker
    from fxpipe.runtime.launch.worker import main as worker_main

    monkeypatch.setattr(worker, "tie_to_parent", lambda *_: "not here: this is the test process")
    text, fragment = OPTIONS[name]
    (tmp_path / "options.json").write_bytes(text)
    assert worker_main([str(mlp_copy), "--options", str(tmp_path / "options.json")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: [rank ") and fragment in err and len(err.strip().splitlines()) == 1
    ), err
