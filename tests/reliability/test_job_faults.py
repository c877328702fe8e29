"""Faults in a running 2-rank ``fxpipe run``: the right rank is blamed, and every process is gone within seconds.

Each probe starts ``fxpipe run`` as a user would, waits until it trains, injects one
fault (a signal to a rank, to torchrun's agent or to the launcher; a closed stdout; a
model file's ``loss_fn`` that raises or exits on the last rank) and measures the time
until no process of the job is left. The bounds are generous (a loaded 2-core machine)
but far below torchrun's own 30 s shutdown grace and the 300 s default timeout.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from procs import FaultyRun, alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GONE_S = 6.0  # every process gone this long after a rank, the agent or the launcher is killed


def _slow(build: Path, timeout_s: float = 20.0, sigint: str = "inherited") -> FaultyRun:
    run = FaultyRun(build, timeout_s=timeout_s, env={"FXPIPE_PROBE_LOSS": "slow"}, sigint=sigint)
    run.wait_for_step(3)
    return run


def _error(run: FaultyRun) -> str:
    err = run.error_text
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("rank", "sig"), [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGTERM)]
)
def test_a_killed_rank_is_named_with_its_signal(
    rank: int, sig: signal.Signals, leaf_project: Path
) -> None:
    run = _slow(leaf_project / "build")
    assert run.signal_and_time(run.worker(rank), sig) < GONE_S
    assert run.proc.returncode == 2
    assert f"rank {rank} was killed by {sig.name}" in _error(run)


def test_a_stopped_rank_is_reported_at_the_timeout_and_the_job_ends_then(
    leaf_project: Path,
) -> None:
    timeout = 3.0
    run = _slow(leaf_project / "build", timeout_s=timeout)
    seconds = run.signal_and_time(run.worker(1), signal.SIGSTOP)
    assert seconds < timeout + GONE_S, seconds  # not torchrun's 30 s grace on top
    assert run.proc.returncode == 2 and f"no answer within the {timeout:g} s timeout" in _error(run)


@pytest.mark.parametrize("who", ["agent", "launcher"])
def test_workers_die_with_the_agent_and_the_launcher(who: str, leaf_project: Path) -> None:
    run = _slow(leaf_project / "build")
    assert run.signal_and_time(next(iter(run.job()[who])), signal.SIGKILL) < GONE_S


@pytest.mark.parametrize("sigint", ["inherited", "ignored", "blocked"])
def test_ctrl_c_on_the_launcher_stops_the_job(sigint: str, leaf_project: Path) -> None:
    """Also when ``fxpipe run`` was started with SIGINT ignored (``fxpipe run … &`` in a script, or
    anything a process started that way starts: ``make test-heavy &`` failed here) or blocked."""
    run = _slow(leaf_project / "build", sigint=sigint)
    assert run.signal_and_time(run.proc.pid, signal.SIGINT, limit_s=30.0) < GONE_S
    assert run.proc.returncode == 130 and _error(run) == "error: interrupted"


def test_a_closed_stdout_ends_the_job_quietly(leaf_project: Path) -> None:
    """``fxpipe run … | head -3``: the reader goes away; the job must not wedge until the timeout."""
    run = _slow(leaf_project / "build", timeout_s=60.0)
    everyone = set().union(*run.job().values())
    assert run.proc.stdout is not None
    run.proc.stdout.close()
    assert run.time_until_gone(everyone) < GONE_S
    assert run.proc.returncode == 141 and run.error_text == ""


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        (
            "raise",
            "rank 1: internal error while training: ValueError: bad loss on purpose (at model.py:",
        ),
        ("exit", "rank 1: internal error while training: sys.exit(3) was called (at model.py:"),
        ("_exit", "rank 1 exited with code 7 without an fxpipe error"),
    ],
)
def test_the_last_ranks_own_error_wins_over_its_peers_reaction(
    how: str, expected: str, leaf_project: Path
) -> None:
    """A user's loss_fn failing on the last rank: that error is the one shown, not rank 0's PeerError."""
    start = time.monotonic()
    run = FaultyRun(leaf_project / "build", steps=2, timeout_s=20.0, env={"FXPIPE_PROBE_LOSS": how})
    run.proc.wait(120)
    line = _error(run)
    assert expected in line and "PeerError" not in line and "receiving" not in line, line
    assert run.proc.returncode == 2 and time.monotonic() - start < 60
    assert not alive(descendants(run.proc.pid))
