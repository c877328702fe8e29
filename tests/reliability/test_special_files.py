"""Special files and outputs over inputs (Note [regular files only] in fxpipe.userfiles).

A FIFO in place of a checkpoint's record is refused at once by every reader (``run
--resume``, ``run`` that saves, ``export``), never waited on until a timeout; ``fxpipe export``
never writes over the checkpoint it reads. Each probe runs as a subprocess with a time limit,
so a hang fails the probe instead of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from procs import fxpipe_env

LIMIT_S = 120  # far below what a hang would take: a run's timeout, or forever for export


def _fxpipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fxpipe", *args],
        capture_output=True,
        text=True,
        env=fxpipe_env(),
        timeout=LIMIT_S,
    )


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


SAVE = """
import sys
import torch
from fxpipe.runtime.train.checkpoint import save_training_checkpoint
state = {"step": 1, "replica": 0, "stages": [0], "num_stages": 1,
         "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}}
save_training_checkpoint(sys.argv[1], 0, 1, state)
"""


def _save(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SAVE, str(directory)],
        capture_output=True,
        text=True,
        env=fxpipe_env(),
        timeout=LIMIT_S,
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A one-rank checkpoint of two tensors."""
    proc = _save(tmp_path / "ck")
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "ck"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("out", ["rank_0.pt", "checkpoint.json", ".", "link.pt"])
def test_export_never_writes_over_its_checkpoint(out: str, checkpoint: Path) -> None:
    (checkpoint.parent / "link.pt").symlink_to(checkpoint / "rank_0.pt")
    target = checkpoint.parent / "link.pt" if out == "link.pt" else checkpoint / out
    before = _snapshot(checkpoint)
    assert "writing it would destroy its input" in _one_error(
        _fxpipe("export", str(checkpoint), "--out", str(target))
    )
    assert _snapshot(checkpoint) == before
    good = _fxpipe("export", str(checkpoint), "--out", str(checkpoint.parent / "model.safetensors"))
    assert good.returncode == 0, good.stderr


def test_export_of_a_build_directory_says_what_export_reads(tmp_path: Path) -> None:
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "manifest.json").write_text("{}")
    line = _one_error(
        _fxpipe("export", str(tmp_path / "build"), "--out", str(tmp_path / "m.safetensors"))
    )
    assert "is a build directory" in line and "--checkpoint-dir" in line and "--resume" not in line


def _fifo_record(checkpoint: Path) -> None:
    (checkpoint / "checkpoint.json").unlink()
    os.mkfifo(checkpoint / "checkpoint.json")


FIFO = "the checkpoint record"


def test_export_refuses_a_fifo_record(checkpoint: Path) -> None:
    _fifo_record(checkpoint)
    line = _one_error(
        _fxpipe("export", str(checkpoint), "--out", str(checkpoint.parent / "m.safetensors"))
    )
    assert f"{FIFO} {str(checkpoint / 'checkpoint.json')!r} is a FIFO, not a regular file" in line


def test_a_save_refuses_a_fifo_record(checkpoint: Path) -> None:
    """What a worker does at a save (no launcher's preflight): one error, the FIFO left as it was."""
    _fifo_record(checkpoint)
    proc = _save(checkpoint)
    assert (
        proc.returncode == 1 and "is a FIFO, not a regular file" in proc.stderr.splitlines()[-1]
    ), proc.stderr
    assert (checkpoint / "checkpoint.json").is_fifo()


@pytest.mark.parametrize("resume", [True, False])
def test_run_refuses_a_fifo_record_before_it_starts(
    resume: bool, checkpoint: Path, mlp_copy: Path
) -> None:
    _fifo_record(checkpoint)
    proc = _fxpipe(
        "run",
        str(mlp_copy),
        "--steps",
        "2",
        "--timeout",
        "100",
        "--checkpoint-dir",
        str(checkpoint),
        *(["--resume"] if resume else []),
    )
    assert "is a FIFO, not a regular file" in _one_error(proc)
