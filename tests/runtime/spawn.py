"""The one spawn helper for multi-process runtime tests.

``spawn(fn, nprocs, *args)`` starts ``nprocs`` fresh processes with torchrun's
environment (gloo on 127.0.0.1, a free port), runs ``fn(rank, nprocs, *args)`` in each,
and returns each rank's result. A rank that raises or exits non-zero fails the call
(unless ``expect_failure``); a job still running after ``timeout`` seconds is killed
and fails it too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from fxpipe.runtime.launch.launcher import free_port


@dataclass(frozen=True)
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0


def _child(
    fn: Callable[..., Any], rank: int, nprocs: int, port: int, args: tuple, results: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        value = fn(rank, nprocs, *args)
    except BaseException as exc:  # report everything, including SystemExit
        results.put(
            pickle.dumps(
                RankResult(
                    rank,
                    False,
                    None,
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                    time.perf_counter() - start,
                )
            )
        )
        results.close()
        results.join_thread()
        _leave(1)
    # plain pickle: tensors travel as bytes, not as shared memory that dies with this process
    results.put(pickle.dumps(RankResult(rank, True, value, "", time.perf_counter() - start)))
    results.close()
    results.join_thread()
    _leave(0)


def _leave(code: int) -> None:
    """Exit without interpreter teardown: the result is reported, and destroying gloo groups
    still held by DDP reducers can hang in their thread joins (seen with torch 2.13)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 120.0,
    expect_failure: bool = False,
    heavy: bool = False,
) -> list[RankResult]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` processes; results in rank order.
    ``heavy``: up to 8 processes, for tests in ``make test-heavy`` (tests/conftest.py HEAVY)."""
    most = 8 if heavy else 4
    assert 1 <= nprocs <= most, f"keep spawned jobs small: 1-{most} processes"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, nprocs, port, args, results), daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, RankResult] = {}
    while len(got) < nprocs and time.monotonic() < deadline:
        try:
            res = pickle.loads(results.get(timeout=0.2))
            got[res.rank] = res
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                try:
                    while True:
                        res = pickle.loads(results.get(timeout=0.5))
                        got[res.rank] = res
                except queue.Empty:
                    break
    timed_out = len(got) < nprocs and time.monotonic() >= deadline
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()) + 5)
        if p.is_alive():
            p.kill()
            p.join()
    out = []
    for r, p in enumerate(procs):
        if r in got:
            res = got[r]
            if res.ok and p.exitcode not in (0, None):
                res = RankResult(r, False, res.value, f"exited with code {p.exitcode}", res.seconds)
            out.append(res)
        else:
            why = (
                f"killed after the {timeout:g} s timeout"
                if timed_out
                else f"exited with code {p.exitcode}"
            )
            out.append(RankResult(r, False, None, why))
    if not expect_failure and not all(r.ok for r in out):
        raise AssertionError(
            "spawned job failed:\n"
            + "\n".join(f"--- rank {r.rank}: {r.error}" for r in out if not r.ok)
        )
    return out
