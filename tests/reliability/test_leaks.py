"""Nothing left behind: a seed-API first step killed while rank 0 writes its build leaves a folder that
the next first step removes; the ranks' own stage files never touch the disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe.smp import partitioning as build
from procs import fxpipe_env

ROOT = Path(__file__).resolve().parents[2]

FIRST_STEP = """
import os, signal, sys
import torch
import fxpipe as smp
import fxpipe.smp.partitioning as build
from fxpipe.modelfile import load_model_file

if sys.argv[1] == "die":  # SIGKILL right after rank 0 has written the build into its scratch folder
    real = build.write_build_dir
    def write_then_die(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    build.write_build_dir = write_then_die

source = load_model_file({mlp!r})
smp.init({{"partitions": 1, "microbatches": 2}})
model = smp.DistributedModel(source.build_model())

@smp.step
def step(model, x, y):
    loss = source.loss_fn(model(x), y)
    model.backward(loss)
    return loss

step(model, source.example_inputs(4)[0], source.example_targets(4))
os._exit(0)  # no interpreter teardown, no atexit: as after a SIGKILL
"""


def _first_step(tmp: Path, how: str) -> int:
    env = {
        **fxpipe_env(),
        "TMPDIR": str(tmp),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_port()),
    }
    script = FIRST_STEP.format(mlp=str(ROOT / "examples" / "mlp.py"))
    return subprocess.run(
        [sys.executable, "-c", script, how], env=env, capture_output=True, timeout=300
    ).returncode


def _port() -> int:
    from fxpipe.runtime.launch.launcher import free_port

    return free_port()


def _fxpipe_files(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if "fxpipe" in p.name)


@pytest.mark.slow
def test_a_first_step_killed_mid_build_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    assert _first_step(tmp_path, "die") == -9
    left = _fxpipe_files(tmp_path)
    assert len(left) == 1 and left[0].startswith(
        "fxpipe-plan-"
    )  # the SIGKILL window: rank 0's scratch
    assert _first_step(tmp_path, "live") == 0
    assert _fxpipe_files(tmp_path) == []


def test_orphaned_scratch_folders_of_dead_processes_only_are_removed(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    for pid in (int(dead.stdout), os.getpid()):
        (tmp_path / f"fxpipe-plan-{pid}-abc").mkdir()
    (tmp_path / "fxpipe-plan-notapid").mkdir()
    build._remove_orphaned_scratch()
    assert _fxpipe_files(tmp_path) == sorted(
        [f"fxpipe-plan-{os.getpid()}-abc", "fxpipe-plan-notapid"]
    )
