"""``os._exit(0)`` in a model file: never a silent exit 0 (Note [os._exit in user code] in fxpipe.unexpected).

Run as subprocesses: without the fix, ``os._exit(0)`` would end pytest itself with status 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from probe_builds import make_build
from procs import fxpipe_env

ROOT = Path(__file__).resolve().parents[2]

# os._exit(0) at import when FXPIPE_PROBE_EXIT names this process's role ("any", or "worker": only under torchrun)
EXITING = (
    (ROOT / "examples" / "mlp.py").read_text()
    + """

import os as _os
if _os.environ.get("FXPIPE_PROBE_EXIT") == "any" or (
        _os.environ.get("FXPIPE_PROBE_EXIT") == "worker" and "RANK" in _os.environ):
    _os._exit(0)
"""
)


def _fxpipe(*args: str, exit_at: str) -> subprocess.CompletedProcess[str]:
    env = {**fxpipe_env(), "FXPIPE_PROBE_EXIT": exit_at}
    return subprocess.run(
        [sys.executable, "-m", "fxpipe", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def exiting_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.pop("FXPIPE_PROBE_EXIT", None)
    return make_build(tmp_path_factory.mktemp("exiting") / "project", EXITING)


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_partition_of_a_model_file_that_exits_at_import(
    exiting_build: Path, tmp_path: Path
) -> None:
    proc = _fxpipe(
        "partition",
        str(exiting_build.parent / "model.py"),
        "--stages",
        "2",
        "--out",
        str(tmp_path / "b"),
        exit_at="any",
    )
    assert "it called os._exit(0)" in _one_error(proc)
    assert not (tmp_path / "b").exists()


def test_verify_of_a_model_file_that_exits_at_import(exiting_build: Path) -> None:
    assert "it called os._exit(0)" in _one_error(
        _fxpipe("verify", str(exiting_build), exit_at="any")
    )


@pytest.mark.slow
@pytest.mark.parametrize("where", ["any", "worker"])
def test_run_of_a_model_file_that_exits_at_import(where: str, exiting_build: Path) -> None:
    """In the launcher (its preflight imports the model file) and in the workers only."""
    proc = _fxpipe("run", str(exiting_build), "--steps", "2", "--timeout", "20", exit_at=where)
    assert "it called os._exit(0)" in _one_error(proc)
    assert not (exiting_build / "run.json").exists()


def test_os_exit_outside_user_code_still_exits() -> None:
    """The guard is lifted after the block: fxpipe's own processes can still end with os._exit."""
    code = (
        "from fxpipe.unexpected import exits_raise, ExitCalled\nimport os\n"
        "try:\n    with exits_raise():\n        os._exit(5)\nexcept ExitCalled as e:\n    print(e.code)\n"
        "os._exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=fxpipe_env(), timeout=60
    )
    assert proc.returncode == 3 and proc.stdout.strip() == "5"


def test_a_child_forked_inside_the_guard_still_exits() -> None:
    """multiprocessing's fork start method ends each child with os._exit: the child must end there, not run on."""
    code = (
        "import multiprocessing as mp\nfrom fxpipe.unexpected import exits_raise\n"
        "def work():\n    pass\n"
        "with exits_raise():\n    p = mp.get_context('fork').Process(target=work)\n    p.start()\n    p.join(60)\n"
        "    print('child exit code', p.exitcode)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=fxpipe_env(), timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "child exit code 0", (
        proc.stdout,
        proc.stderr,
    )
