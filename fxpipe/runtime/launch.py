"""``run_build``: train a build directory on this machine with one torchrun process per stage and replica.

It runs PyTorch's own launcher, ``python -m torch.distributed.run`` (torchrun), with a
c10d rendezvous on a free local port and ``-m fxpipe.runtime.worker DIR --options
FILE`` as each rank's entry point (``stages x dp`` ranks; FILE holds the ``RunOptions``
as JSON), then returns the ``RunRecord`` that rank 0 wrote to ``run.json``. Jobs
spanning several machines call torchrun themselves with the same entry point.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import IO

from fxpipe import errors
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import FxpipeError
from fxpipe.runtime.options import RunOptions
from fxpipe.runtime.record import RunRecord
from fxpipe.runtime.worker import ERROR_PREFIX

__all__ = ["run_build", "torchrun_command", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(build_dir: str | Path, nproc: int, port: int, worker_args: list[str]) -> list[str]:
    """The torchrun command line that starts ``nproc`` workers on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
            "-m", "fxpipe.runtime.worker", str(build_dir), *worker_args]


def _tee(stream: IO[str], sink: IO[str], keep: list[str]) -> None:
    for line in stream:
        sink.write(line)
        sink.flush()
        if line.startswith(ERROR_PREFIX):
            keep.append(line.strip())


def _raise_worker_error(lines: list[str], returncode: int) -> None:
    """Re-raise the root cause: the first error that is not a peer's reaction to it."""
    parsed = []
    for line in lines:
        head, _, message = line[len(ERROR_PREFIX):].partition(" ")  # "R]" and "Kind: message"
        kind, _, text = message.partition(": ")
        cls = getattr(errors, kind, None)
        cls = cls if isinstance(cls, type) and issubclass(cls, FxpipeError) else FxpipeError
        parsed.append((cls, f"rank {head.rstrip(']')}: {text}"))
    root = [p for p in parsed if p[0] is not errors.PeerError] or parsed
    if root:
        cls, text = root[0]
        raise cls(text)
    raise errors.PeerError(f"the torchrun job exited with code {returncode} without an fxpipe error: a worker "
                           "crashed; see the output above for its traceback")


def run_build(build_dir: str | Path, options: RunOptions | None = None, quiet: bool = False) -> RunRecord:
    """Launch torchrun with one worker per stage and replica, train as ``options`` say, return ``DIR/run.json``.

    ``options.dp`` replicas of the pipeline (``stages x dp`` processes; ``None``: 1) each
    train on their own ``batch_size`` rows of the model file's ``example_inputs(batch_size x
    dp)`` and average gradients with DDP (``options.data_parallel``). The options are
    checked here, before any process starts, and handed to the workers as a JSON file.

    >>> result = run_build("build/gpt", RunOptions(steps=5, schedule="gpipe", microbatches=4))  # doctest: +SKIP
    >>> result.losses, result.step_seconds  # doctest: +SKIP
    """
    build_dir = Path(build_dir)
    manifest = Manifest.from_json(build_dir)
    options = options or RunOptions()
    replicas = options.dp if options.dp is not None else 1
    options = replace(options, dp=replicas)  # checks the options that need 2+ replicas before any process starts
    out = build_dir / "run.json"
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="fxpipe-run-") as tmp:
        options_file = Path(tmp) / "run_options.json"
        options.to_json(options_file)
        cmd = torchrun_command(build_dir, manifest.num_ranks * replicas, free_port(), ["--options", str(options_file)])
        returncode, errors_seen = _run(cmd, quiet)
    if returncode != 0 or not out.is_file():
        _raise_worker_error(errors_seen, returncode)
    return RunRecord.from_json(out)


def _run(cmd: list[str], quiet: bool) -> tuple[int, list[str]]:
    """Run ``cmd``, passing its output on (unless ``quiet``); its exit code and the workers' error lines."""
    sink = open("/dev/null", "w") if quiet else sys.stdout  # noqa: SIM115 - closed below
    errors_seen: list[str] = []
    try:
        # torchrun would set OMP_NUM_THREADS=1 anyway, with a banner; set it quietly instead.
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        threads = [threading.Thread(target=_tee, args=(proc.stdout, sink, errors_seen)),
                   threading.Thread(target=_tee, args=(proc.stderr, sys.stderr if not quiet else sink, errors_seen))]
        for t in threads:
            t.start()
        returncode = proc.wait()
        for t in threads:
            t.join()
    finally:
        if quiet:
            sink.close()
    return returncode, errors_seen
