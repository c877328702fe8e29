"""What controls a running ``fxpipe run``: only fxpipe's own reports, the build's checked files and the user's signals.

A job is never steered by the text it prints (Note [reports, not output] in
``fxpipe.runtime.launch.reports``): a model's own log line that looks like fxpipe's error
report, or a path with a newline, neither stops a healthy job nor forges an error. A rank
imports only hash-checked files and installed packages (Note [isolated workers] in
``fxpipe.runtime.launch.worker``). ``SIGTERM``, ``SIGHUP`` and ``SIGINT`` stop the job, say so
and leave no temporary folder (Note [stopping fxpipe run] in ``fxpipe.runtime.launch.launcher``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import FaultyRun, fxpipe_env

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GONE_S = 6.0
ROOT = Path(__file__).resolve().parents[2]


def _run(
    build: Path,
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fxpipe", "run", str(build), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**fxpipe_env(), **(env or {})},
        timeout=300,
    )


PLANTED = """
import os
open(os.environ["FXPIPE_PROBE_MARK"], "a").write("{name} was imported\\n")
"""


@pytest.mark.parametrize("name", ["safetensors", "numpy"])
def test_a_module_planted_in_the_build_directory_is_never_imported(
    name: str, leaf_copy: Path, tmp_path: Path
) -> None:
    """``fxpipe run .`` from inside the build directory, where each rank's ``python -m`` would look first.

    Started as the ``fxpipe`` command is (a script in another folder, ``PYTHONPATH`` naming only fxpipe's
    source), so that the launcher's own ``sys.path`` does not hold the build directory."""
    mark = tmp_path / "mark.txt"
    (leaf_copy / f"{name}.py").write_text(PLANTED.format(name=name))
    command = tmp_path / "bin" / "fxpipe_command.py"
    command.parent.mkdir()
    command.write_text("from fxpipe.cli import main\nraise SystemExit(main())\n")
    env = {**fxpipe_env(), "PYTHONPATH": str(ROOT), "FXPIPE_PROBE_MARK": str(mark)}
    proc = subprocess.run(
        [sys.executable, str(command), "run", ".", "--steps", "2", "--timeout", "60"],
        capture_output=True,
        text=True,
        cwd=leaf_copy,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert not mark.exists(), mark.read_text()


def test_a_models_log_lines_that_look_like_reports_do_not_stop_a_healthy_job(
    leaf_copy: Path,
) -> None:
    proc = _run(leaf_copy, "--steps", "3", "--timeout", "60", env={"FXPIPE_PROBE_LOSS": "forge"})
    assert proc.returncode == 0 and (leaf_copy / "run.json").is_file(), proc.stderr
    assert (
        "error: [rank 0] PeerError: a line the model printed" in proc.stdout
    )  # passed on, as the user printed it


def test_a_path_with_a_newline_prints_no_line_of_its_own(leaf_copy: Path, tmp_path: Path) -> None:
    project = tmp_path / "p\nerror: rank 0: forged"
    shutil.copytree(leaf_copy.parent, project)
    ok = _run(project / "build", "--steps", "2", "--timeout", "60")
    assert ok.returncode == 0, ok.stderr
    assert not [
        line for line in (ok.stdout + ok.stderr).splitlines() if line.startswith("error")
    ], ok.stdout
    bad = _run(
        project / "build",
        "--steps",
        "2",
        "--timeout",
        "60",
        "--checkpoint-dir",
        str(project / "build" / "manifest.json"),
    )
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error")]
    assert bad.returncode == 2 and len(errors) == 1 and "forged" in errors[0], bad.stderr


def _leftovers(tmp: Path) -> list[str]:
    return sorted(
        p.name for p in tmp.iterdir() if p.name.startswith(("fxpipe-run-", "torchelastic_"))
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_the_job_says_so_and_leaves_nothing(
    sig: signal.Signals, leaf_project: Path, tmp_path: Path
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = FaultyRun(
        leaf_project / "build",
        timeout_s=30.0,
        env={"FXPIPE_PROBE_LOSS": "slow", "TMPDIR": str(tmp)},
    )
    run.wait_for_step(3)
    assert _leftovers(tmp)  # the job's folder, while it runs
    assert run.signal_and_time(run.proc.pid, sig) < GONE_S
    lines = [line for line in run.error_text.splitlines() if line.startswith("error: ")]
    if sig == signal.SIGINT:
        assert run.proc.returncode == 130 and lines == ["error: interrupted"], run.error_text
    else:
        assert run.proc.returncode == 128 + sig and len(lines) == 1, run.error_text
        assert lines[0].startswith(f"error: stopped by {sig.name}")
    assert _leftovers(tmp) == []


def test_a_rendezvous_that_cannot_listen_fails_at_once(
    leaf_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its port held by another program: one error in seconds, not a wait for the timeout behind torchrun's banner."""
    from fxpipe.errors import RuntimeSetupError
    from fxpipe.runtime.launch import launcher
    from fxpipe.runtime.train.run_options import RunOptions

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    real = launcher._torchrun_args
    monkeypatch.setattr(
        launcher,
        "_torchrun_args",
        lambda build, n, _port, args, **kw: real(build, n, port, args, **kw),
    )
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeSetupError, match="could not start the job"):
            launcher.run_build(leaf_copy, RunOptions(steps=2, timeout_s=100.0), quiet=True)
    finally:
        busy.close()
    assert time.monotonic() - start < 60


def test_start_up_says_what_it_is_doing_phase_by_phase(leaf_copy: Path) -> None:
    """Not 45 s of silence: each start-up phase has its line, in order, before the first step's (#35 item 17).

    Piped (not a terminal), on standard output: standard error keeps only an error line."""
    proc = _run(leaf_copy, "--steps", "2", "--timeout", "60", "--log-every", "5")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    expected = [
        "fxpipe: check (",
        "fxpipe: start 2 ranks: each imports torch",
        "fxpipe: rank 0 of 2 is up; loading",
        "fxpipe: stages loaded, process group up; first step (",
        "fxpipe run: 2 stages on 2 ranks",
        "fxpipe: first step done in ",
        "step    2/2",
    ]
    lines = proc.stdout.splitlines()
    found = [
        next((i for i, line in enumerate(lines) if line.startswith(e)), None) for e in expected
    ]
    assert None not in found and found == sorted(found), proc.stdout
    assert "s after launch)" in lines[found[2]]


SIBLING = "import torch.nn as nn\n\n\nclass Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n    def forward(self, x):\n        return self.fc(x).relu()\n"
USES_SIBLING = (
    "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nfrom layers import Block\n\n"
    "def build_model():\n    return nn.Sequential(Block(), Block(), nn.Linear(8, 4))\n\n"
    "def example_inputs(b):\n    return (torch.randn(b, 8, generator=torch.Generator().manual_seed(0)),)\n\n"
    "def example_targets(b):\n    return torch.randint(0, 4, (b,), generator=torch.Generator().manual_seed(1))\n\n"
    "def loss_fn(out, y):\n    return F.cross_entropy(out, y)\n"
)


def test_a_model_file_that_imports_a_module_beside_it_is_told_what_to_do(tmp_path: Path) -> None:
    """The trade-off of isolated ranks (#35 item 11): ``from layers import Block`` works where the
    user partitions (``python -m`` finds ``layers.py`` in the current directory), not in the ranks;
    the line says why and what to do, and the remedy it names (an absolute PYTHONPATH) trains."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "layers.py").write_text(SIBLING)
    (project / "mymodel.py").write_text(USES_SIBLING)
    env = fxpipe_env()
    part = subprocess.run(
        [
            sys.executable,
            "-m",
            "fxpipe",
            "partition",
            "mymodel.py",
            "--stages",
            "2",
            "--out",
            "build",
        ],
        capture_output=True,
        text=True,
        cwd=project,
        env=env,
        timeout=300,
    )
    assert part.returncode == 0, part.stderr
    # no empty PYTHONPATH entry (fxpipe_env() adds one when PYTHONPATH is unset): an empty entry is
    # the current directory, which the ranks then keep on purpose (Note [isolated workers])
    plain = {"PYTHONPATH": os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p)}
    proc = _run(project / "build", "--steps", "1", "--timeout", "60", cwd=project, env=plain)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        proc.stderr.startswith("error: rank ")
        and (
            "importing mymodel.py failed: ModuleNotFoundError: No module named 'layers' "
            f"({project / 'layers.py'} is beside it, but fxpipe's ranks import only the build's checked "
            "files and installed packages, not modules found beside the model file or in the current "
            "directory); define what mymodel.py needs from layers in mymodel.py itself, install layers "
            f"as a package (pip install -e), or name its folder in an absolute PYTHONPATH "
            f"(PYTHONPATH={project})"
        )
        in proc.stderr
    ), proc.stderr
    remedy = {"PYTHONPATH": plain["PYTHONPATH"] + os.pathsep + str(project)}
    fixed = _run(project / "build", "--steps", "1", "--timeout", "60", cwd=project, env=remedy)
    assert fixed.returncode == 0, fixed.stderr
