"""How long gloo's point-to-point calls take on this host while both ranks compute: what the step model leaves out.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/gloo_stalls.py [--iterations 800] [--out benchmarks/prediction]

Two processes (gloo on 127.0.0.1, one thread each, as ``fxpipe run``'s ranks) run a
pipeline's steady state: post the next receive, compute a fixed workload (~1 ms),
send a tensor the size of the tiny GPT's boundary activation, wait for the current
receive. It times every ``irecv`` post, ``isend`` post and ``wait``, and every compute
(against the same compute with no messages), and reads each thread's CPU time and
context switches from ``/proc`` (the main thread against gloo's ``gloo_tcp_loop``
transport thread). It also measures the host's scheduler time slice: ``cores + 1``
processes spin and record how long each is kept off a core.

The step model charges ``RuntimeCosts.message_ms`` per message on each end, plus
``message_stall_ms`` per message for an action that starts while every core is busy
(Note [message stalls]), and otherwise treats a message as a delay on its link (Note
[step simulation]). This benchmark measures both on a 2-core host: the transport
thread's own CPU time per message, and calls that wait a whole time slice when that
thread needs a core both ranks are using. Writes gloo_stalls.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MESSAGE_FLOATS = 2048  # 8 KiB: the tiny GPT's activation per microbatch of 2
LABELS = {"compute_alone": "compute, no messages"}
STALL_MS = 1.0  # a posting call or a compute this much longer than usual waited for a core


def _compute(x: Any, w: Any) -> Any:
    import torch

    for _ in range(5):
        x = torch.tanh(x @ w)
    return x


def _threads() -> dict[str, tuple[float, int]]:
    """CPU seconds and context switches of this process's threads, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        name, fields = (
            stat[stat.index("(") + 1 : stat.rindex(")")],
            stat[stat.rindex(")") + 2 :].split(),
        )
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        switches = sum(
            int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line
        )
        cpu, n = out.get(name, (0.0, 0))
        out[name] = (cpu + (int(fields[11]) + int(fields[12])) / tick, n + switches)
    return out


def _summary(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {
        "median_ms": statistics.median(s),
        "mean_ms": statistics.fmean(s),
        "p99_ms": s[int(0.99 * (len(s) - 1))],
        "stalled_share": sum(v > STALL_MS for v in s) / len(s),
    }


def _rank(rank: int, port: int, iterations: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    x, w = torch.randn(64, 256), torch.randn(256, 256) / 16
    alone = []
    for _ in range(iterations // 4):
        t = time.perf_counter()
        _compute(x, w)
        alone.append((time.perf_counter() - t) * 1e3)
    dist.barrier()
    buffers = [torch.zeros(MESSAGE_FLOATS) for _ in range(4)]
    out = torch.ones(MESSAGE_FLOATS)
    times: dict[str, list[float]] = {"irecv": [], "compute": [], "isend": [], "wait": []}
    receives: list[Any] = [dist.irecv(buffers[0], peer)]
    sends: list[Any] = []
    before = _threads()
    for i in range(iterations):
        t0 = time.perf_counter()
        receives.append(dist.irecv(buffers[(i + 1) % 4], peer))
        t1 = time.perf_counter()
        _compute(x, w)
        t2 = time.perf_counter()
        sends.append(dist.isend(out, peer))
        t3 = time.perf_counter()
        receives.pop(0).wait()
        t4 = time.perf_counter()
        for key, a, b in (
            ("irecv", t0, t1),
            ("compute", t1, t2),
            ("isend", t2, t3),
            ("wait", t3, t4),
        ):
            times[key].append((b - a) * 1e3)
        if len(sends) > 3:
            sends.pop(0).wait()
    after = _threads()
    sends.append(dist.isend(out, peer))  # matches the receive each rank still has posted
    for work in [*sends, *receives]:
        work.wait()
    threads = {
        name: {
            "cpu_s": cpu - before.get(name, (0.0, 0))[0],
            "switches": n - before.get(name, (0.0, 0))[1],
        }
        for name, (cpu, n) in after.items()
    }
    queue.put(
        {
            "rank": rank,
            "compute_alone": _summary(alone),
            **{k: _summary(v) for k, v in times.items()},
            "messages": 2 * iterations,
            "threads": threads,
        }
    )
    dist.destroy_process_group()


def _spin(seconds: float, queue: Any) -> None:
    """Spin; report how long this process was kept off a core each time (gaps over 0.2 ms)."""
    gaps, last = [], time.perf_counter()
    end = last + seconds
    while last < end:
        now = time.perf_counter()
        if now - last > 2e-4:
            gaps.append((now - last) * 1e3)
        last = now
    queue.put(gaps)


def _time_slice(cores: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(2.0, queue)) for _ in range(cores + 1)]
    for p in procs:
        p.start()
    gaps = [g for _ in procs for g in queue.get(timeout=120)]
    for p in procs:
        p.join(30)
    return {
        "processes": cores + 1,
        "gaps": len(gaps),
        "median_gap_ms": statistics.median(gaps) if gaps else 0.0,
    }


def measure(iterations: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT))
    from fxpipe.runtime.launch.launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, iterations, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    cores = len(os.sched_getaffinity(0))
    return {
        "iterations": iterations,
        "message_bytes": 4 * MESSAGE_FLOATS,
        "cores": cores,
        "ranks": ranks,
        "time_slice": _time_slice(cores),
    }


def _markdown(result: dict[str, Any]) -> list[str]:
    from fxpipe.partitioner.prediction import RUNTIME_COSTS

    ts = result["time_slice"]
    posting = statistics.fmean(r[k]["mean_ms"] for r in result["ranks"] for k in ("irecv", "isend"))
    lines = [
        "# gloo point-to-point calls while both ranks compute",
        "",
        f"2 ranks, gloo on 127.0.0.1, one thread each, {result['cores']} cores; {result['iterations']} iterations "
        f"of: post the next receive, compute (~1 ms), send {result['message_bytes']} bytes, wait for the "
        f"current receive. 'stalled': the call took over {STALL_MS:g} ms. A posting call (irecv or isend, "
        f"both ranks) took {posting:.3f} ms in the mean; the step model charges "
        f"{RUNTIME_COSTS['cpu'].message_ms} ms per message on each end (`RuntimeCosts.message_ms`), plus "
        f"{RUNTIME_COSTS['cpu'].message_stall_ms} ms where an action starts on busy cores, as here "
        "(`message_stall_ms`, Note [message stalls]).",
        "",
        "| rank | call | median ms | mean ms | p99 ms | stalled |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["ranks"]:
        for key in ("irecv", "isend", "wait", "compute", "compute_alone"):
            s = r[key]
            lines.append(
                f"| {r['rank']} | {LABELS.get(key, key)} | "
                f"{s['median_ms']:.3f} | {s['mean_ms']:.3f} | {s['p99_ms']:.2f} | {s['stalled_share']:.1%} |"
            )
    lines += [
        "",
        "| rank | thread | CPU ms per message | context switches per message |",
        "|---|---|---|---|",
    ]
    for r in result["ranks"]:
        for name, t in sorted(r["threads"].items(), key=lambda kv: -kv[1]["cpu_s"]):
            if t["cpu_s"] > 0 or name.startswith("gloo"):
                lines.append(
                    f"| {r['rank']} | {name} | {1e3 * t['cpu_s'] / r['messages']:.3f} | "
                    f"{t['switches'] / r['messages']:.2f} |"
                )
    lines += [
        "",
        f"Scheduler time slice: {ts['processes']} spinning processes on {result['cores']} cores were kept "
        f"off a core {ts['gaps']} times, for a median {ts['median_gap_ms']:.2f} ms each.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=800)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    result = measure(args.iterations)
    lines = _markdown(result)
    print("\n".join(lines))
    (args.out / "gloo_stalls.md").write_text("\n".join(lines) + "\n")
    (args.out / "gloo_stalls.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
