"""What a data-parallel stage's gradient synchronisation costs per step, beyond its all-reduce.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/ddp_sync_cost.py [--passes 50] [--out benchmarks/prediction]

Two gloo processes on 127.0.0.1 (one thread each, as ``fxpipe run``'s replicas) wrap the
same gradient bytes (213 KB, examples/gpt.py's) in 1, 13, 52 (the tiny GPT itself) and
208 parameter tensors in ``fxpipe.runtime.dataparallel.DataParallelStage`` and time its
``sync_gradients`` (DDP's synchronising pass, Note [one all-reduce per step]) against a
plain ``dist.all_reduce`` of a flat buffer of the same bytes, each the median of
``--passes`` after a barrier. The step model prices the pass as the all-reduce's link
time plus ``RuntimeCosts.dp_sync_ms`` and ``dp_sync_tensor_ms`` per parameter tensor
(Note [data-parallel sync cost]); the table sets the measurement beside that.
Writes ddp_sync_cost.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FLOATS = 53_440  # examples/gpt.py's parameters: 213,760 bytes in 52 tensors
VARIANTS = (1, 13, 52, 208)


def _stage(tensors: int) -> Any:
    import torch
    import torch.nn as nn

    if tensors == 52:
        sys.path.insert(0, str(ROOT / "examples"))
        import gpt

        return gpt.build_model()
    per = FLOATS // tensors
    return nn.ParameterList([nn.Parameter(torch.ones(per)) for _ in range(tensors)])


def _rank(rank: int, port: int, passes: int, queue: Any) -> None:
    import time

    import torch
    import torch.distributed as dist

    from fxpipe.runtime.dataparallel.options import DataParallelOptions
    from fxpipe.runtime.dataparallel.replica import DataParallelStage

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)

    sizes, calls = (
        [],
        [],
    )  # per variant: (tensors, bytes), (the sync pass, a plain all-reduce of its bytes)
    for tensors in VARIANTS:
        stage = _stage(tensors)
        sync = DataParallelStage(stage, None, DataParallelOptions(), torch.device("cpu"))
        params = list(stage.parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        flat = torch.ones(sum(p.numel() for p in params))
        sizes.append((len(params), flat.numel() * 4))
        calls.append((sync.sync_gradients, functools.partial(dist.all_reduce, flat)))
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in calls]
    for i in range(
        passes + 5
    ):  # in rounds over the variants: a slow moment of the host falls on all of them
        for pair, got in zip(calls, times):
            for call, into in zip(pair, got):
                dist.barrier()
                t = time.perf_counter()
                call()
                if i >= 5:
                    into.append((time.perf_counter() - t) * 1e3)
    rows = [
        {
            "tensors": n,
            "bytes": nbytes,
            "sync_ms": statistics.median(sync_times),
            "all_reduce_ms": statistics.median(reduce_times),
        }
        for (n, nbytes), (sync_times, reduce_times) in zip(sizes, times)
    ]
    queue.put((rank, rows))
    dist.destroy_process_group()


def _predicted(nbytes: int, tensors: int) -> tuple[float, float]:
    """The model's all-reduce (link time and collective hops) and the whole pass, 2 replicas, ms."""
    from fxpipe.partitioner import CostModel
    from fxpipe.partitioner.prediction import RUNTIME_COSTS

    cpu, cost = RUNTIME_COSTS["cpu"], CostModel(dp_replicas=2)
    reduce = cost.allreduce_ms([nbytes]) + cost.dp_hops([nbytes]) * cpu.collective_ms
    return reduce, reduce + cpu.dp_sync_ms + tensors * cpu.dp_sync_tensor_ms


def _markdown(rows: list[dict[str, Any]], passes: int) -> str:
    lines = [
        "# DDP's synchronising pass vs a plain all-reduce",
        "",
        f"2 gloo processes, one thread each, median of {passes} passes; per rank 'rank 0, rank 1'. "
        "Predicted: the step model's all-reduce (link time + `collective_ms` per ring hop) and the "
        "whole pass (+ `dp_sync_ms` + `dp_sync_tensor_ms` per tensor, Note [data-parallel sync cost]).",
        "",
        "| tensors | bytes | sync pass ms | plain all-reduce ms | predicted all-reduce ms | predicted pass ms | "
        "measured / predicted pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tensors']} | {r['bytes']:,} | {r['sync_ms'][0]:.2f}, {r['sync_ms'][1]:.2f} | "
            f"{r['all_reduce_ms'][0]:.2f}, {r['all_reduce_ms'][1]:.2f} | {r['predicted_all_reduce_ms']:.2f} | "
            f"{r['predicted_pass_ms']:.2f} | {max(r['sync_ms']) / r['predicted_pass_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    import torch.multiprocessing as mp

    from fxpipe.runtime.launch.launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.passes, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(60)
    rows = []
    for r0, r1 in zip(got[0], got[1]):
        reduce, whole = _predicted(r0["bytes"], r0["tensors"])
        rows.append(
            {
                "tensors": r0["tensors"],
                "bytes": r0["bytes"],
                "sync_ms": [r0["sync_ms"], r1["sync_ms"]],
                "all_reduce_ms": [r0["all_reduce_ms"], r1["all_reduce_ms"]],
                "predicted_all_reduce_ms": reduce,
                "predicted_pass_ms": whole,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ddp_sync_cost.json").write_text(
        json.dumps({"rows": rows, "passes": args.passes}, indent=1) + "\n"
    )
    text = _markdown(rows, args.passes)
    (args.out / "ddp_sync_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
