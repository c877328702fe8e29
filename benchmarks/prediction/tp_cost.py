"""What a split pair costs beyond its compute share and its all-reduces' link time (``tp_pair_ms``).

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/tp_cost.py [--widths 32,128] [--iters 60] [--rounds 5]

Two gloo processes on this host, one thread each, both running the same thing at once (as the
ranks of a tp group do). For an MLP shaped like examples/gpt.py's (``fc`` Linear(W, 4W), GELU,
``proj`` Linear(4W, W), input (2, 16, W) float32), each rank times in rounds, medians of
``--iters`` forward + backward passes per round (and the forward alone, autograd recording):

- ``plain``: the MLP whole on each rank (no communication);
- ``tp``: the MLP split as fxpipe's runtime splits it (``parallelize_stage``: ``fc`` colwise,
  ``proj`` rowwise, the MLP the pair's owner, implicit replication on), tp degree 2;
- ``allreduce``: ``dist.all_reduce`` of the rowwise output's bytes, alone.

``tp_pair_ms = tp - plain / 2 - 2 x allreduce_ms(bytes, 2, loopback)``: the pair's cost per
microbatch (forward and backward together) beyond its compute share and the two all-reduces
as ``fxpipe.partitioner.tensor_parallel`` prices them on the loopback link (DTensor's dispatch
and redistribution, gloo's calls on busy cores). The measured all-reduce is printed beside it.
Writes tp_cost.json and tp_cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

OUT = Path(__file__).resolve().parent


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _time(fn: Any, iters: int) -> float:
    times = []
    for i in range(iters + 5):
        dist.barrier()
        t = time.perf_counter()
        fn()
        if i >= 5:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _worker(rank: int, port: int, widths: list[int], iters: int, rounds: int, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from fxpipe.codegen.tp_plan import ResolvedStagePlan
    from fxpipe.runtime.pipeline.tensor_parallel import implicit_replication_on, parallelize_stage

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out: dict[int, dict[str, list[float]]] = {}
    for width in widths:
        torch.manual_seed(0)
        plain = Block(width)
        split = Block(width)
        split.load_state_dict(plain.state_dict())
        plan = ResolvedStagePlan(
            styles={"mlp.fc": "colwise", "mlp.proj": "rowwise"},
            groups=("mlp.proj",),
            replicated=(),
            owners=("mlp",),
        )
        parallelize_stage(split, plan, mesh)
        x = torch.randn(2, 16, width)
        buf = torch.randn(2, 16, width)

        def run(model: nn.Module) -> None:
            xi = x.clone().requires_grad_(True)
            model(xi).sum().backward()

        def forward(model: nn.Module) -> None:  # as in training: autograd records the graph
            model(x.clone().requires_grad_(True))

        figures: dict[str, list[float]] = {
            "plain": [],
            "tp": [],
            "plain_fwd": [],
            "tp_fwd": [],
            "allreduce": [],
        }
        for _ in range(rounds):
            figures["plain"].append(_time(lambda: run(plain), iters))
            figures["plain_fwd"].append(_time(lambda: forward(plain), iters))
            with implicit_replication_on():
                figures["tp"].append(_time(lambda: run(split), iters))
                figures["tp_fwd"].append(_time(lambda: forward(split), iters))
            figures["allreduce"].append(_time(lambda: dist.all_reduce(buf), iters))
        out[width] = figures
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="32,128")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    from fxpipe.partitioner.cost import LINK_PRESETS
    from fxpipe.partitioner.tensor_parallel import allreduce_ms

    widths = [int(w) for w in args.widths.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 2000
    procs = [
        ctx.Process(target=_worker, args=(r, port, widths, args.iters, args.rounds, q))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    figures = q.get(timeout=1800)
    for proc in procs:
        proc.join()
    bw, lat = LINK_PRESETS["loopback"]
    rows = []
    for width in widths:
        f = {k: statistics.median(v) for k, v in figures[width].items()}
        nbytes = 2 * 16 * width * 4
        priced = allreduce_ms(nbytes, 2, bw, lat)
        rows.append(
            {
                "width": width,
                "bytes": nbytes,
                "plain_ms": f["plain"],
                "tp_ms": f["tp"],
                "allreduce_ms": f["allreduce"],
                "allreduce_priced_ms": priced,
                "tp_pair_ms": f["tp"] - f["plain"] / 2 - 2 * priced,
                "tp_pair_fwd_ms": f["tp_fwd"] - f["plain_fwd"] / 2 - priced,
                "rounds": figures[width],
            }
        )
    load = os.getloadavg()[0]
    (args.out / "tp_cost.json").write_text(
        json.dumps({"rows": rows, "iters": args.iters, "load_average_1min": load}, indent=1) + "\n"
    )
    lines = [
        "# What a split pair costs (tp_pair_ms)",
        "",
        "Two gloo processes, one thread each, tp 2, an MLP like examples/gpt.py's at input "
        f"(2, 16, W); medians of {args.rounds} rounds of {args.iters} forward + backward passes. "
        "tp_pair_ms = split - whole / 2 - 2 x the all-reduce as priced on the loopback link. "
        f"Load average {load:.1f}.",
        "",
        "| W | all-reduce bytes | whole ms | split ms | all-reduce ms measured | as priced "
        "| tp_pair_ms | of it in forward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['bytes']} | {r['plain_ms']:.3f} | {r['tp_ms']:.3f} | "
            f"{r['allreduce_ms']:.3f} | {r['allreduce_priced_ms']:.3f} | {r['tp_pair_ms']:.3f} | "
            f"{r['tp_pair_fwd_ms']:.3f} |"
        )
    (args.out / "tp_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
