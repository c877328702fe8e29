"""``run_build``: train a build directory on this machine with one torchrun process per stage and replica.

It runs PyTorch's own launcher, ``python -m torch.distributed.run`` (torchrun), with a
c10d rendezvous on a free local port and ``-m fxpipe.runtime.worker DIR`` as each
rank's entry point (``stages x dp`` ranks), then returns the ``run.json`` that rank 0
wrote. Jobs spanning several machines call torchrun themselves with the same entry point.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from fxpipe import errors
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import ConfigError, FxpipeError, RuntimeSetupError

__all__ = ["run_build", "torchrun_command", "free_port"]

_PREFIX = "error: [rank "


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
        if line.startswith(_PREFIX):
            keep.append(line.strip())


def _raise_worker_error(lines: list[str], returncode: int) -> None:
    """Re-raise the root cause: the first error that is not a peer's reaction to it."""
    parsed = []
    for line in lines:
        head, _, message = line[len(_PREFIX):].partition(" ")  # "R]" and "Kind: message"
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


def run_build(build_dir: str | Path, steps: int = 10, schedule: str = "1f1b", microbatches: int | None = None,
              batch_size: int | None = None, lr: float = 0.01, timeout_s: float = 300.0,
              device: str | None = None, quiet: bool = False, dp: int = 1, comm_hook: str = "allreduce",
              powersgd_rank: int = 1, shard_optimizer_state: bool = False,
              backward_passes_per_step: int = 1) -> dict[str, Any]:
    """Launch torchrun with one worker per stage and replica, train ``steps`` SGD steps, return ``DIR/run.json``.

    ``dp`` replicas of the pipeline (``stages x dp`` processes) each train on their own
    ``batch_size`` rows of the model file's ``example_inputs(batch_size x dp)`` and average
    gradients with DDP (``comm_hook``, ``powersgd_rank``, ``shard_optimizer_state``,
    ``backward_passes_per_step``: see ``DataParallelOptions``).

    >>> result = run_build("build/gpt", steps=5, schedule="gpipe", microbatches=4)  # doctest: +SKIP
    >>> result["losses"], result["step_seconds"]  # doctest: +SKIP
    """
    from fxpipe.runtime.dataparallel import DataParallelOptions

    build_dir = Path(build_dir)
    manifest = Manifest.from_json(build_dir)
    if steps < 1:
        raise RuntimeSetupError(f"--steps must be >= 1, got {steps}")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ConfigError(f"--dp must be an int >= 1 (the number of pipeline replicas), got {dp!r}; "
                          "use 1 for no data parallelism")
    # validated here so that a bad option fails before torchrun starts stages x dp processes
    DataParallelOptions(comm_hook=comm_hook, powersgd_rank=powersgd_rank, shard_optimizer_state=shard_optimizer_state,
                        backward_passes_per_step=backward_passes_per_step).check_replicas(dp)
    if steps % backward_passes_per_step:
        raise ConfigError(f"--steps {steps} is not a multiple of --backward-passes-per-step "
                          f"{backward_passes_per_step}: the last {steps % backward_passes_per_step} passes would "
                          f"accumulate gradients that are never applied; use --steps "
                          f"{steps - steps % backward_passes_per_step + backward_passes_per_step}")
    out = build_dir / "run.json"
    out.unlink(missing_ok=True)
    args = ["--steps", str(steps), "--schedule", schedule, "--lr", repr(lr), "--timeout", repr(timeout_s)]
    if microbatches is not None:
        args += ["--microbatches", str(microbatches)]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size)]
    if device is not None:
        args += ["--device", device]
    args += ["--dp", str(dp), "--comm-hook", comm_hook, "--powersgd-rank", str(powersgd_rank),
             "--backward-passes-per-step", str(backward_passes_per_step)]
    if shard_optimizer_state:
        args += ["--shard-optimizer-state"]
    cmd = torchrun_command(build_dir, manifest.num_stages * dp, free_port(), args)
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
    if returncode != 0 or not out.is_file():
        _raise_worker_error(errors_seen, returncode)
    return json.loads(out.read_text())
