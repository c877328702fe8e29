"""``run_build``: train a build directory on this machine with one torchrun process per stage and replica.

It runs PyTorch's own launcher (torchrun's ``torch.distributed.run``, through
``fxpipe.runtime.launch.agent``) with a c10d rendezvous on a free local port and ``-m
fxpipe.runtime.launch.worker DIR --options FILE`` as each rank's entry point (``stages x dp``
ranks; FILE holds the ``RunOptions`` as JSON), then returns the ``RunRecord`` that rank 0
wrote to ``run.json``. Jobs spanning several machines call torchrun themselves with the
same entry point (``torchrun_command``).

Note [ending a job]: the build directory is checked against its manifest before any
process starts (the weights by the rank that loads them). The workers' output is passed
on and never read for control: each failed rank, and the agent, report into the job's
folder (Note [reports, not output] in ``fxpipe.runtime.launch.reports``), and the root
cause is raised as one error: the first error that is not a peer's reaction to it, else a
rank that died without a word (killed by a signal: which one; or an exit code), else a
peer's report. The job ends within seconds of the first failure: torchrun waits 30 s for
a rank that ignores ``SIGTERM`` (a stopped one) when a peer failed (its
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, set to ``_SHUTDOWN_S`` here, only applies when the agent
itself is signalled), so ``_GRACE_S`` after the first report the launcher kills the
agent, and every worker dies with it (``fxpipe.runtime.launch.lifeline``). When our own
standard output is closed (``fxpipe run … | head``), the job is stopped quietly and
``BrokenPipeError`` is raised. Everything a job writes outside the build (the options
file, the reports, torchrun's log folder: ``--log-dir``) lies in one ``fxpipe-run-*``
temporary folder, removed however the job ends. The rendezvous store listens on a port
the agent picks itself (``127.0.0.1:0``, the store's host by configuration), so no port can
be taken between choosing it and using it, and a rendezvous that cannot start fails at
once instead of waiting for the timeout as a client of whatever holds the port.

Note [start-up phases]: a job spends from 45 s to minutes before its first step (every
rank imports torch, loads and checks its stages, joins the process group, allocates in
the first step), so each phase says what it is doing as it starts: the launcher's ``check``
(the build and the first batch, a ``phase`` of ``fxpipe.tracer.progress`` as in ``fxpipe
partition``) and ``start N ranks`` (on the same stream: standard error on a terminal,
else standard output, so that standard error keeps only the error line), then rank 0's
own lines, in order with the rest of its output (``fxpipe.runtime.train.log.start_up_note``,
timed from the launch): when it is up and loads its stages, when every rank has loaded and
the first step runs, and when that step is done if its log line comes later.

Note [stopping fxpipe run]: ``SIGTERM`` and ``SIGHUP`` to the launcher stop the job as
Ctrl-C does (``become_launcher``): the agent is asked to stop its workers, the temporary
folder is removed, and ``fxpipe run`` prints ``error: stopped by SIGTERM ...`` and exits
128 + the signal's number.

Note [Ctrl-C]: ``fxpipe run`` stops the job on ``SIGINT`` (exit 130, ``error:
interrupted``) however it was started. A process inherits an ignored ``SIGINT`` (and a
blocked one) across ``exec``: a non-interactive shell starts every ``cmd &`` with
``SIGINT`` ignored, and so does anything started from such a process (a CI step, ``make``
run in the background, pytest). Python then never installs its ``KeyboardInterrupt``
handler, and the launcher would ignore a Ctrl-C while torchrun's agent, which installs its
own handler, does not. ``become_launcher`` restores the handler in the ``fxpipe run``
process. The job is gone within a second or two of the signal, also on a loaded machine:
the launcher and the agent freeze what torch's import left on the heap (``gc.freeze``)
before the job starts, so that their interpreters' final garbage collection skips it
(without that, each spent seconds "Garbage-collecting" at exit on a busy 2-core machine,
and the agent was killed at ``_STOP_S`` rather than ending on its own).
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fxpipe import errors
from fxpipe.codegen.integrity import check_build
from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import FxpipeError
from fxpipe.runtime.pipeline.groups import pick_device
from fxpipe.runtime.launch.isolation import isolated_env
from fxpipe.runtime.launch.lifeline import PARENT_PID_ENV
from fxpipe.runtime.launch.reports import (
    JOB_DIR_ENV,
    RankError,
    read_agent_failures,
    read_rank_errors,
)
from fxpipe.runtime.train.run_options import RunOptions, with_plan_defaults
from fxpipe.runtime.train.run_record import RunRecord, build_sha256
from fxpipe.runtime.train.log import PROGRESS_ENV, STARTED_ENV, ProgressBar
from fxpipe.runtime.launch.worker import DEBUG_ENV
from fxpipe.tracer.progress import note, phase
from fxpipe.unexpected import SignalStop, print_safely

__all__ = ["run_build", "torchrun_command", "free_port", "become_launcher"]

_GRACE_S = 2.0  # after the first error line, how long the other ranks get to end on their own
_STOP_S = 3.0  # after asking the agent to stop, how long before it is killed
_SHUTDOWN_S = 2  # torchrun's grace for a worker between SIGTERM and SIGKILL (its default: 30 s)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def become_launcher() -> None:
    """Set this process up as ``fxpipe run`` (Note [Ctrl-C]): ``SIGINT`` raises ``KeyboardInterrupt``
    even when the process was started with it ignored or blocked, and torch's objects are frozen
    out of the garbage collector. For the main thread of a process that exists to run one job
    (not for a caller of ``run_build``: both are process-wide)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # Note [stopping fxpipe run]
        signal.signal(sig, _stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    import fxpipe.runtime.launch.preflight  # noqa: F401  (imports torch, as the launcher does anyway: frozen with the rest)

    gc.freeze()


def _stop(signum: int, frame: Any) -> None:
    raise SignalStop(signum)


def torchrun_command(
    build_dir: str | Path, nproc: int, port: int, worker_args: list[str]
) -> list[str]:
    """The torchrun command line that starts ``nproc`` workers on this machine (``port`` 0: any free one)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *_torchrun_args(build_dir, nproc, port, worker_args),
    ]


def _torchrun_args(
    build_dir: str | Path,
    nproc: int,
    port: int,
    worker_args: list[str],
    log_dir: Path | None = None,
) -> list[str]:
    logs = ["--log-dir", str(log_dir)] if log_dir is not None else []
    where = str(build_dir)
    if where.startswith("-"):  # a build named "-b" is a path to the worker's parser, not an option
        where = os.path.join(".", where)
    return [
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "is_host=1",
        "--max-restarts",
        "0",
        *logs,
        "-m",
        "fxpipe.runtime.launch.worker",
        where,
        *worker_args,
    ]


@dataclass
class _Job:
    """One running torchrun job, and the folder its ranks and agent report into (Note [reports, not output])."""

    proc: subprocess.Popen[str]
    reports: Path | None = None
    first_error_at: float | None = None
    output_closed: threading.Event = field(default_factory=threading.Event)
    log_lost: str | None = None  # why a stream of the log could not be written (a full disk)
    threads: list[threading.Thread] = field(default_factory=list)

    def errors(self) -> list[RankError]:
        return read_rank_errors(self.reports) if self.reports is not None else []

    def failures(self) -> list[dict[str, Any]]:
        return read_agent_failures(self.reports) if self.reports is not None else []


def _tee(job: _Job, stream: IO[str], sink: IO[str] | None) -> None:
    """Copy ``stream`` to ``sink`` line by line (nothing in it is read for control: Note [reports, not output]);
    a closed ``sink`` sets ``job.output_closed`` and the rest is drained unseen. A ``sink`` that
    fails otherwise (a full disk under the log file) loses the rest of its lines but not the job:
    training goes on, and ``job.log_lost`` says why (once on standard error now, and at the end)."""
    bar = ProgressBar()  # a worker's progress lines, drawn in place (fxpipe.runtime.train.log)
    for line in stream:
        if sink is None:
            continue
        try:
            if bar.draw(line, sink):
                continue
            sink.write(line)
            sink.flush()
        except (BrokenPipeError, ValueError):  # `| head` is done reading; ValueError: a closed file
            job.output_closed.set()
            sink = None
        except OSError as exc:  # ENOSPC, EIO: the disk under the log, not the reader, failed
            which = "standard output" if sink is sys.stdout else "standard error"
            job.log_lost = (
                f"cannot write {which}: {exc.strerror or exc}; training went on without those lines "
                "(run.json records every step)"
            )
            sink = None
            print_safely(
                f"fxpipe run: {job.log_lost}",
                sys.stderr if which == "standard output" else sys.stdout,
            )


def run_build(
    build_dir: str | Path,
    options: RunOptions | None = None,
    quiet: bool = False,
    *,
    debug: bool = False,
    explicit: frozenset[str] = frozenset(),
) -> RunRecord:
    """Launch torchrun with one worker per stage and replica, train as ``options`` say, return ``DIR/run.json``.

    ``options.dp`` replicas of the pipeline (``stages x dp`` processes; ``None``: the plan's) each
    train on their own ``batch_size`` rows of the model file's ``example_inputs(batch_size x
    dp)`` and average gradients with DDP (``options.data_parallel``; its sharding level the plan's
    unless ``explicit`` names it: ``with_plan_defaults``). The options and the
    build directory are checked here, before any process starts, and the options handed
    to the workers as a JSON file. ``debug``: workers print tracebacks and every error
    line. Raises the root cause of a failed job as one ``FxpipeError`` (Note [ending a
    job]), ``BrokenPipeError`` when standard output was closed.

    >>> result = run_build("build/gpt", RunOptions(steps=5, schedule="gpipe", microbatches=4))  # doctest: +SKIP
    >>> result.losses, result.step_seconds  # doctest: +SKIP
    """
    build_dir = Path(build_dir)
    sinks = (
        sys.stdout,
        sys.stderr,
    )  # before any phase's live display replaces them (Note [start-up phases])
    with phase("check") as checking:
        manifest = Manifest.from_json(build_dir)
        checked = check_build(
            build_dir, weights=False, model=bool(manifest.model_file), manifest=manifest
        )
        # the plan's replicas and sharding where the options leave them open; checks the options that need
        # 2+ replicas before any process starts
        options = with_plan_defaults(options or RunOptions(), checked.read_plan(), explicit)
        replicas = options.dp or 1
        ranks = manifest.num_ranks * options.tp  # processes per pipeline replica
        _check_world(pick_device(options.device, 0), ranks, replicas)
        from fxpipe.runtime.launch.preflight import preflight

        options = preflight(
            build_dir, manifest, options, ranks * replicas
        )  # a bad model file: one line
        checking.detail = "the build's files, the model file, the first batch"
    ran = build_sha256(build_dir)  # Note [a record names its build]
    out = build_dir / "run.json"
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="fxpipe-run-", ignore_cleanup_errors=True) as tmp:
        folder = Path(tmp)
        options_file = folder / "run_options.json"
        options.to_json(options_file)
        (folder / "reports").mkdir()
        args = _torchrun_args(
            build_dir,
            ranks * replicas,
            0,
            ["--options", str(options_file)],
            log_dir=folder / "torchelastic",
        )
        if not quiet:
            note(
                f"start {ranks * replicas} ranks: each imports torch, loads its stages and joins the "
                "process group"
            )
        job = _start(
            [sys.executable, "-m", "fxpipe.runtime.launch.agent", *args],
            quiet,
            debug,
            folder / "reports",
            build_dir,
            sinks,
        )
        returncode = _wait(job)
        reported, failures = job.errors(), job.failures()
    if job.log_lost is not None:
        print_safely(f"fxpipe run: the log is incomplete: {job.log_lost}")
    if returncode == 0 and build_dir.is_dir():
        return _own_record(build_dir, out, ran)
    if job.output_closed.is_set():
        raise BrokenPipeError("standard output was closed; the job was stopped")
    if returncode == 0 and not reported and not failures and not build_dir.is_dir():
        raise errors.BuildDirError(
            f"the build directory {str(build_dir)!r} was removed while the job ran; "
            "nothing was recorded"
        )
    raise root_cause(reported, failures, returncode)


def _own_record(build_dir: Path, out: Path, ran: str | None) -> RunRecord:
    """The record the job wrote into ``out``, refused when it is not of the build the job ran."""
    record = RunRecord.from_json(out) if out.is_file() else None
    if record is None or (ran is not None and record.build_sha256 not in (None, ran)):
        raise errors.BuildDirError(
            f"the build directory {build_dir} was replaced while this run trained (re-"
            f"partitioned?): {out} {'is gone' if record is None else 'is of another run'}, "
            "and this run's record is not in it"
        )
    return record


def _check_world(device: Any, stages: int, replicas: int) -> None:
    """Refuse, in one line, a job of more CUDA ranks than this machine has GPUs."""
    if device.type != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count()
    if stages * replicas > gpus:
        raise errors.RuntimeSetupError(
            f"{stages} stages x {replicas} replicas = {stages * replicas} ranks, but this machine has {gpus} GPUs; "
            f"run --dp {max(gpus // stages, 1)} (the plan's replicas are the default), or --device cpu"
        )


def _start(
    cmd: list[str],
    quiet: bool,
    debug: bool,
    reports: Path | None = None,
    build_dir: Path | None = None,
    sinks: tuple[IO[str] | None, IO[str] | None] | None = None,
) -> _Job:
    # torchrun would set OMP_NUM_THREADS=1 anyway, with a banner; set it quietly instead.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        PARENT_PID_ENV: str(os.getpid()),
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(_SHUTDOWN_S),
    }
    env.pop(DEBUG_ENV, None)
    env.pop(JOB_DIR_ENV, None)
    if reports is not None:
        env[JOB_DIR_ENV] = str(reports)
        env[STARTED_ENV] = repr(
            time.time()
        )  # rank 0's start-up lines say how long since (Note [start-up phases])
    env[PROGRESS_ENV] = "1" if not quiet and sys.stdout is not None and sys.stdout.isatty() else "0"
    if debug:
        env[DEBUG_ENV] = "1"
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=isolated_env(env, str(build_dir)) if build_dir is not None else env,
    )
    job = _Job(proc, reports)
    out, err = sinks if sinks is not None else (sys.stdout, sys.stderr)
    for stream, sink in (
        (proc.stdout, None if quiet else out),
        (proc.stderr, None if quiet else err),
    ):
        assert stream is not None
        job.threads.append(threading.Thread(target=_tee, args=(job, stream, sink), daemon=True))
        job.threads[-1].start()
    return job


def _wait(job: _Job) -> int:
    """Wait for the job to end, ending it early as Note [ending a job] says; its exit code."""
    stop_at: float | None = None
    try:
        while True:
            try:
                returncode = job.proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if job.first_error_at is None and job.errors():
                job.first_error_at = now
            if stop_at is None and job.output_closed.is_set():
                job.proc.send_signal(signal.SIGTERM)  # the agent stops its workers and exits
                stop_at = now + _STOP_S
            if (stop_at is not None and now > stop_at) or (
                job.first_error_at is not None and now > job.first_error_at + _GRACE_S
            ):
                job.proc.kill()  # every worker dies with the agent (fxpipe.runtime.launch.lifeline)
    except BaseException:  # KeyboardInterrupt, SignalStop: stop the job before giving up on it
        try:
            job.proc.send_signal(signal.SIGTERM)
            job.proc.wait(timeout=_STOP_S)
        except (
            subprocess.TimeoutExpired,
            KeyboardInterrupt,
            SignalStop,
        ):  # a second signal: stop at once
            job.proc.kill()
            job.proc.wait()
        raise
    # the output threads end when the last worker closes the pipes (at once: they died with the agent)
    deadline = time.monotonic() + 5.0
    for t in job.threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return returncode


def _kind(report: RankError) -> type[FxpipeError]:
    cls = getattr(errors, report.kind or "", None)
    return cls if isinstance(cls, type) and issubclass(cls, FxpipeError) else FxpipeError


def _with_rank(rank: int | None, text: str) -> str:
    prefix = f"rank {rank if rank is not None else '?'}"
    return (
        text
        if text.startswith(prefix + ":") or text.startswith(prefix + " ")
        else f"{prefix}: {text}"
    )


def _death(failure: dict[str, Any]) -> str:
    rank, code, sig = failure.get("rank"), failure.get("exitcode"), failure.get("signal")
    if sig:
        hint = (
            " (out of memory? the kernel's OOM killer sends SIGKILL: see `dmesg`)"
            if sig == "SIGKILL"
            else ""
        )
        return f"rank {rank} was killed by {sig} and printed no error{hint}; the other ranks stopped with it"
    return (
        f"rank {rank} exited with code {code} without an fxpipe error; its output above may say why"
    )


def root_cause(
    reports: list[RankError], failures: list[dict[str, Any]], returncode: int
) -> FxpipeError:
    """The error to raise for a failed job (Note [ending a job]); ``reports`` earliest first."""
    real = [r for r in reports if _kind(r) is not errors.PeerError]
    if real:
        return _kind(real[0])(_with_rank(real[0].rank, real[0].message))
    agent = next((f for f in failures if "agent_error" in f), None)
    if agent is not None:
        return errors.RuntimeSetupError(
            f"torchrun's agent could not start the job: {agent['agent_error']}"
        )
    explained = {r.rank for r in reports}
    # the first to fail; on a tie, not one that the agent's own SIGTERM may have ended
    silent = sorted(
        (f for f in failures if f.get("rank") not in explained),
        key=lambda f: (f.get("time") or 0, f.get("signal") == "SIGTERM"),
    )
    if silent:
        return errors.PeerError(_death(silent[0]))
    if reports:
        return _kind(reports[0])(_with_rank(reports[0].rank, reports[0].message))
    if returncode < 0:
        name = (
            signal.Signals(-returncode).name
            if -returncode in signal.Signals._value2member_map_
            else -returncode
        )
        return errors.PeerError(
            f"the torchrun agent was killed by {name}; every worker stopped with it"
        )
    return errors.PeerError(
        f"the torchrun job exited with code {returncode} without an fxpipe error; its output "
        "above may say why"
    )
