"""How fast this host delivers messages between two computing processes right now: a steadiness probe.

This host has stretches in which a gloo message whose sender goes on computing arrives much
later than usual, while a one-thread compute workload keeps its speed (Note [message
stalls]; benchmarks/prediction/README.md). ``MessageProbe`` keeps two gloo processes
(127.0.0.1, one thread each, as ``fxpipe run``'s ranks) waiting for the word; each
``measure()`` has them run ``iterations`` of a pipeline's steady state (post a receive,
compute ~1 ms, send 8 KiB, wait) and returns the mean ms per iteration, stalls included.
configurations.py takes it before and after each run.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/message_probe.py [--probes 5]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

FLOATS = 2048  # 8 KiB: the tiny GPT's boundary activation per microbatch of 2
TIMEOUT_S = 60.0  # a start or a pass that takes longer: the probe is broken


class ProbeError(RuntimeError):
    """The probe's processes did not start or did not answer: the benchmark stops (no row is to blame)."""


def _worker(rank: int, port: int, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    peer = 1 - rank
    x, w = torch.randn(64, 256), torch.randn(256, 256) / 16
    out, into = torch.zeros(FLOATS), torch.zeros(FLOATS)
    conn.send("ready")
    while True:
        iterations = conn.recv()
        if iterations is None:
            break
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            receive = dist.irecv(into, peer)
            y = x
            for _ in range(5):
                y = torch.tanh(y @ w)
            dist.isend(out, peer).wait()
            receive.wait()
        conn.send((time.perf_counter() - start) / iterations * 1e3)
    dist.destroy_process_group()


class MessageProbe:
    """Two gloo processes that measure message delivery on demand (a context manager)."""

    def __init__(self, iterations: int = 200) -> None:
        self.iterations = iterations
        self._procs: list[Any] = []
        self._conns: list[Connection] = []

    def __enter__(self) -> MessageProbe:
        from fxpipe.runtime.launch.launcher import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        try:
            for rank in range(2):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(rank, port, child), daemon=True)
                proc.start()
                child.close()  # the worker's end: when it dies, recv sees the pipe close
                self._procs.append(proc)
                self._conns.append(parent)
            for conn in self._conns:
                if self._answer(conn) != "ready":
                    raise ProbeError("the message probe's processes did not start")
            self.measure()  # the first pass warms up the connections
        except BaseException:
            self.__exit__()
            raise
        return self

    def _answer(self, conn: Connection) -> Any:
        if not conn.poll(TIMEOUT_S):
            raise ProbeError(f"a message probe process gave no answer in {TIMEOUT_S:.0f} s")
        try:
            return conn.recv()
        except EOFError as exc:
            codes = [proc.exitcode for proc in self._procs]
            raise ProbeError(f"a message probe process died (exit codes {codes})") from exc

    def measure(self) -> float:
        """Mean ms per iteration of the slower process."""
        for conn in self._conns:
            conn.send(self.iterations)
        return max(self._answer(conn) for conn in self._conns)

    def __exit__(self, *exc: object) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--iterations", type=int, default=200)
    args = p.parse_args(argv)
    with MessageProbe(args.iterations) as probe:
        times = [probe.measure() for _ in range(args.probes)]
    print(
        " ".join(f"{t:.2f}" for t in times),
        f"ms per iteration (median {statistics.median(times):.2f})",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
