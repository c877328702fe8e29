"""Cluster search: planning time for a 70B-shaped profile, and the simulator's 1F1B vs interleaved ratio on paper.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/cluster_search.py [--out benchmarks/prediction]
        [--searches 64:64 64:256 1024:1024] [--no-paper]

1. ``search_configurations`` on a synthetic Llama-3-70B profile (``llama3_70b_profile``:
   80 blocks, 4096-token sequences, 400 TFLOP/s effective per device, Adam) on 64 and
   1,024 devices of 80 GiB, 8 per node (NVLink in a node, InfiniBand between): wall
   and CPU seconds, the load of the machine, shapes searched / priced / simulated, the
   best configurations. Goal: under 10 s at 64 devices, under 60 s at 1,024.
2. Paper check (Megatron-LM, Narayanan et al. 2021, arXiv 2104.04473): a GPT-3 175B
   shape (96 blocks, hidden 12288, 2048-token sequences) on 12 pipeline stages of one
   8-GPU tensor-parallel node each (a stage = one "device" of 8 x 140 TFLOP/s; every
   pipeline hop on InfiniBand), microbatch 1, batch 12..60: the simulated step of 1F1B
   and of interleaved 1F1B with 2 stages per rank on the same plan's split, and their
   ratio.
Writes cluster_search.json and cluster_search.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def _timed_search(devices: int, global_batch: int) -> dict[str, Any]:
    from fxpipe.partitioner.cluster import ClusterSpec
    from fxpipe.partitioner.search.configurations import search_configurations
    from fxpipe.partitioner.synthetic import llama3_70b_profile

    profile = llama3_70b_profile()
    cluster = ClusterSpec(devices=devices, device_memory=80 * 2**30, node_size=8)
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    result = search_configurations(profile, cluster, global_batch, optimizer="adam")
    return {
        "devices": devices,
        "global_batch": global_batch,
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "load_average_1min": load,
        "shapes": result.candidates,
        "priced": result.priced,
        "simulated": result.simulated,
        "top": [
            {
                "config": s.config.label,
                "step_s": s.step_ms / 1e3,
                "samples_per_s": s.samples_per_s,
                "bubble": s.bubble,
                "memory_gib": s.peak_memory_bytes / 2**30,
                "limit": s.limit,
            }
            for s in result.ranked
        ],
    }


def _interleaved_ratio(batch: int) -> dict[str, Any]:
    from fxpipe.partitioner.cost import CostModel, LINK_PRESETS
    from fxpipe.partitioner.solve.planner import plan_partition
    from fxpipe.partitioner.prediction import RUNTIME_COSTS
    from fxpipe.partitioner.problem import build_problem
    from fxpipe.partitioner.prediction import predict
    from fxpipe.partitioner.synthetic import transformer_profile

    profile = transformer_profile(
        layers=96,
        hidden=12288,
        ffn=32768,
        heads=96,
        kv_heads=96,
        vocab=51200,
        seq=2048,
        device_tflops=8 * 140.0,
        name="gpt3-175b (synthetic)",
    )  # 3 x 12288 x 32768 = 8 h^2
    bandwidth, latency = LINK_PRESETS["infiniband"]
    cost = CostModel(
        link_bandwidth=bandwidth, link_latency=latency, link="infiniband", optimizer="adam"
    )
    steps = {}
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        plan = plan_partition(
            profile,
            12,
            schedule=schedule,
            microbatches=batch,
            cost=cost,
            virtual_stages=v,
            time_limit=5.0,
        )
        assert plan.prediction is not None
        steps[schedule] = plan.prediction.step_ms[schedule]
    # the same check on one split: the interleaved plan's 24 chunks, priced under both loop-placed schedules
    problem = build_problem(
        profile, 12, schedule="interleaved-1f1b", microbatches=batch, cost=cost, virtual_stages=2
    )
    assignment = tuple(plan.stage_of(u.name) for u in profile.units)
    same = predict(problem, assignment, 1, runtime=RUNTIME_COSTS["cuda"])
    analytic = (batch + 11) / (
        batch + 11 / 2
    )  # (m + p - 1) / (m + (p - 1) / v): the bubbles' textbook ratio
    return {
        "batch": batch,
        "microbatches": batch,
        "step_1f1b_s": steps["1f1b"] / 1e3,
        "step_interleaved_s": steps["interleaved-1f1b"] / 1e3,
        "speedup": steps["1f1b"] / steps["interleaved-1f1b"],
        "analytic_speedup": analytic,
        "bubble_interleaved": same.bubble_by_schedule["interleaved-1f1b"],
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Cluster search results",
        "",
        "## Planning time (synthetic Llama-3-70B, Adam, 80 GiB devices, 8 per node)",
        "",
        "| devices | global batch | wall s | CPU s | load (1 min) | shapes | priced | simulated | best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["timing"]:
        best = r["top"][0]
        lines.append(
            f"| {r['devices']} | {r['global_batch']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['load_average_1min']:.1f} | {r['shapes']} | {r['priced']} | {r['simulated']} | "
            f"{best['config']}: {best['step_s']:.2f} s/step, {best['samples_per_s']:.3g} samples/s, "
            f"{best['memory_gib']:.1f} GiB, {best['limit']} |"
        )
    lines += [
        "",
        "## 1F1B vs interleaved 1F1B (V=2), GPT-3 175B shape on 12 stages (Megatron-LM's Figure 12 "
        "setting)",
        "",
        "| batch (= microbatches) | 1F1B step s | interleaved step s | simulated speedup | (m+p-1)/(m+(p-1)/v) |",
        "|---|---|---|---|---|",
    ]
    for r in result["interleaved"]:
        lines.append(
            f"| {r['batch']} | {r['step_1f1b_s']:.2f} | {r['step_interleaved_s']:.2f} | "
            f"{r['speedup']:.3f} | {r['analytic_speedup']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument(
        "--searches",
        nargs="+",
        default=["64:64", "64:256", "1024:1024"],
        metavar="DEVICES:BATCH",
        help="the searches to time (default 64:64 64:256 1024:1024)",
    )
    p.add_argument("--no-paper", action="store_true", help="skip the 1F1B vs interleaved check")
    args = p.parse_args(argv)
    searches = [tuple(int(x) for x in spec.split(":")) for spec in args.searches]
    result = {
        "timing": [_timed_search(devices, batch) for devices, batch in searches],
        "interleaved": []
        if args.no_paper
        else [_interleaved_ratio(b) for b in (12, 24, 36, 48, 60)],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_search.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "cluster_search.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
