"""Processes of a running ``fxpipe run`` job, read from /proc: who they are, and when they are gone.

``FaultyRun`` starts ``fxpipe run`` as a user would (a subprocess), waits until training has
begun, sends one signal to one process of the job (a rank, the torchrun agent or the
launcher itself) and measures how long until every process of the job is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[1]), rest[0]


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies count as gone)."""
    out = set()
    for pid in pids:
        st = _stat(pid)
        if st is not None and st[1] != "Z":
            out.add(pid)
    return out


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _collect(stream: IO[str], sink: list[str]) -> None:
    try:
        sink.extend(iter(stream.readline, ""))
    except ValueError:  # the probe closed the stream (a reader that went away)
        pass


def fxpipe_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@contextmanager
def sigint_for_children(how: str) -> Iterator[None]:
    """Processes started inside get ``SIGINT`` as ``how`` says: ``"inherited"`` (as this process has it),
    ``"ignored"`` (as a non-interactive shell starts ``cmd &``) or ``"blocked"``; both survive ``exec``."""
    if how == "inherited":
        yield
        return
    if how == "ignored":
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        return
    assert how == "blocked", how
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@dataclass
class FaultyRun:
    """``fxpipe run DIR --steps STEPS --timeout TIMEOUT``, started as a subprocess with its output captured
    (``sigint``: how the launcher gets ``SIGINT`` from its parent, see ``sigint_for_children``)."""

    build_dir: Path
    steps: int = 1000
    timeout_s: float = 5.0
    env: dict[str, str] = field(default_factory=dict)
    sigint: str = "inherited"
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "fxpipe",
            "run",
            str(self.build_dir),
            "--steps",
            str(self.steps),
            "--timeout",
            str(self.timeout_s),
        ]
        with sigint_for_children(self.sigint):
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**fxpipe_env(), **self.env},
            )
        for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=_collect, args=(stream, sink), daemon=True).start()

    def wait_for_step(self, step: int, limit_s: float = 120.0) -> None:
        deadline = time.monotonic() + limit_s
        mark = f"step {step:4d}/"
        while not any(line.startswith(mark) for line in self.stdout):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"training never reached step {step}: {''.join(self.stderr)[-2000:]}"
                )
            time.sleep(0.05)

    def job(self) -> dict[str, set[int]]:
        """The job's processes by role: ``launcher``, ``agent`` and ``workers``."""
        pids = descendants(self.proc.pid)
        return {
            "launcher": {self.proc.pid},
            "agent": {p for p in pids if "fxpipe.runtime.launch.agent" in cmdline(p)},
            "workers": {p for p in pids if "fxpipe.runtime.launch.worker" in cmdline(p)},
        }

    def worker(self, rank: int) -> int:
        return next(p for p in self.job()["workers"] if rank_of(p) == rank)

    def signal_and_time(self, pid: int, sig: signal.Signals, limit_s: float = 60.0) -> float:
        """Send ``sig`` to ``pid``; seconds until every process of the job (launcher included) is gone."""
        everyone = set().union(*self.job().values())
        os.kill(pid, sig)
        return self.time_until_gone(everyone, limit_s)

    def time_until_gone(self, everyone: set[int], limit_s: float = 60.0) -> float:
        start = time.monotonic()
        while alive(everyone) and time.monotonic() < start + limit_s:
            time.sleep(0.05)
        seconds = time.monotonic() - start
        for p in alive(everyone):  # the probe failed; leave nothing behind
            os.kill(p, signal.SIGKILL)
        self.proc.wait(10)
        return seconds

    @property
    def error_text(self) -> str:
        time.sleep(0.1)
        return "".join(self.stderr)
