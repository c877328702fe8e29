"""Progress of the long phases: a bar on a terminal, one plain line per phase in a log, silence in a library."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe.tracer.progress import phase, progress_iter, reporting

ROOT = Path(__file__).resolve().parents[2]
_LINE = re.compile(r"^fxpipe: (?P<name>[a-z ]+)( \((?P<detail>[^)]*)\))? \d+\.\d s$")


def _run_phases() -> None:
    with phase("trace") as p:
        p.detail = "symbolic, 3 units"
        with phase("inner"):  # shown as part of the outer phase: no line of its own
            pass
    with phase("count"):
        assert list(progress_iter(range(3), "counting units", True, 3)) == [0, 1, 2]


def test_a_log_gets_one_plain_line_per_phase() -> None:
    log, lines_to = io.StringIO(), io.StringIO()
    with reporting(log, lines=lines_to):
        _run_phases()
    assert log.getvalue() == ""  # not a terminal: nothing live, the lines go to ``lines``
    log = lines_to
    lines = log.getvalue().splitlines()
    assert [_LINE.match(line)["name"] for line in lines] == ["trace", "count"]  # type: ignore[index]
    assert lines[0].startswith("fxpipe: trace (symbolic, 3 units) ")
    assert "\x1b" not in log.getvalue()


def test_a_failed_phase_leaves_no_line() -> None:
    log = io.StringIO()
    with reporting(log), pytest.raises(RuntimeError):
        with phase("solve"):
            raise RuntimeError("boom")
    assert log.getvalue() == ""


def test_a_terminal_gets_a_bar_and_the_same_lines() -> None:
    term = io.StringIO()
    with reporting(term, terminal=True):
        _run_phases()
    text = term.getvalue()
    assert "count: counting units" in text and "3/3" in text  # the running bar
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert "fxpipe: trace (symbolic, 3 units)" in plain and "fxpipe: count" in plain


def test_outside_reporting_phases_say_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    _run_phases()
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def _fxpipe_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}


def test_cli_piped_prints_one_line_per_phase(tmp_path: Path) -> None:
    # on standard output, so that standard error holds nothing but an error line when a verb fails
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fxpipe",
            "partition",
            "examples/mlp.py",
            "--stages",
            "2",
            "--out",
            str(tmp_path / "build"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=_fxpipe_env(),
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("fxpipe: ")]
    assert [_LINE.match(line)["name"] for line in lines] == [  # type: ignore[index]
        "build the model",
        "trace",
        "count",
        "solve",
        "emit",
        "check",
    ]
    assert (
        proc.stdout.splitlines()[:6] == lines
    )  # before the tables, in order, nothing between them
    assert proc.stderr == "" and "\x1b" not in proc.stdout  # no bars, no escape codes


def test_cli_on_a_terminal_shows_progress(tmp_path: Path) -> None:
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fxpipe",
            "trace",
            "examples/mlp.py",
            "--out",
            str(tmp_path / "p.json"),
        ],
        cwd=ROOT,
        stdin=child,
        stdout=child,
        stderr=child,
        env={**_fxpipe_env(), "TERM": "xterm"},
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(main)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert "count: counting units" in text  # the running bar of the count phase
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    for name in ("build the model", "trace", "count"):
        assert f"fxpipe: {name}" in plain
