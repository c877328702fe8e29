"""A 70B Llama traced once on meta with a dynamic sequence dimension, planned at 4k and 32k (#36).

The model is ``benchmarks/scale/llama.py``'s ``build_70b`` (Llama-3-70B's shape) with its rotary
tables sliced by the length (``cos[:t]``), so the sequence dimension is dynamic in
``seq`` 2..32768. One meta trace at ``TRACED`` tokens is re-priced at 4096 and 32768
(``fxpipe.partitioner.seqlen.reprice``, Note [pricing at a length]) and planned into 16 stages;
each is compared with a meta trace made at that length: every unit's FLOPs, forward and backward
times and activation bytes (largest relative difference), and the plan's stage boundaries.

Run from the repository root (several minutes on the 2-core machine):
``PYTHONPATH=. .venv/bin/python benchmarks/shapes/plan_70b.py``; writes ``plan_70b.json`` and
prints a markdown table (copied into README.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scale"))

import llama  # noqa: E402

from fxpipe.modelfile import load_model_file  # noqa: E402
from fxpipe.partitioner import plan_partition  # noqa: E402
from fxpipe.partitioner.seqlen import reprice  # noqa: E402
from fxpipe.tracer import trace_model_file  # noqa: E402
from fxpipe.tracer.profile import ModelProfile  # noqa: E402

MAX = 32768
TRACED = int(os.environ.get("FXPIPE_70B_TRACED", "1024"))
LENGTHS = (4096, 32768)
STAGES, MICROBATCHES = 16, 16


class DynamicLlama(llama.Llama):
    """``llama.Llama`` whose rotary tables cover ``MAX + 1`` positions and are sliced by the length."""

    def __init__(self, shape: llama.LlamaShape) -> None:
        super().__init__(shape, seq=MAX + 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.size(1)
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


# this file is also the model file the benchmark traces (build_model, example_inputs, dynamic_dims)
def build_model() -> nn.Module:
    return DynamicLlama(llama.SHAPES[os.environ.get("FXPIPE_70B_SIZE", "70b")])


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    length = int(os.environ.get("FXPIPE_70B_LEN", str(TRACED)))
    return (torch.zeros(batch_size, length, dtype=torch.long),)


def dynamic_dims() -> dict[str, Any]:
    return {"input_ids": {1: ("seq", 2, MAX)}}


def _trace(length: int, dynamic: bool) -> tuple[ModelProfile, float]:
    os.environ["FXPIPE_70B_LEN"] = str(length)
    source = load_model_file(Path(__file__))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(
            source,
            1,
            trace_device="meta",
            dynamic="model" if dynamic else "none",
            progress=False,
        )
    return traced.profile, time.perf_counter() - start


def _worst(mine: ModelProfile, want: ModelProfile) -> dict[str, float]:
    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), abs(b), 1e-30)

    out = {"fwd_flops": 0.0, "fwd_ms": 0.0, "bwd_ms": 0.0, "activation_bytes": 0.0}
    for u, v in zip(mine.units, want.units, strict=True):
        assert u.name == v.name
        for key in out:
            out[key] = max(out[key], rel(getattr(u, key), getattr(v, key)))
    return out


def _split(profile: ModelProfile) -> tuple[list[str], float, Any]:
    start = time.perf_counter()
    plan = plan_partition(profile, STAGES, microbatches=MICROBATCHES)
    seconds = time.perf_counter() - start
    return [s.units[0] for s in plan.stages], seconds, plan


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    once, trace_s = _trace(TRACED, dynamic=True)
    rows = []
    for length in LENGTHS:
        start = time.perf_counter()
        priced = reprice(once, {"seq": length})
        reprice_s = time.perf_counter() - start
        there, there_s = _trace(length, dynamic=False)
        firsts, plan_s, plan = _split(priced)
        firsts_there, _, plan_there = _split(there)
        # the re-priced plan's split, priced on the trace made there (splits with equal costs tie)
        paths = {u.name: u.module_path for u in there.units}
        same = plan_partition(
            there, STAGES, microbatches=MICROBATCHES, split_at=[paths[f] for f in firsts[1:]]
        )
        rows.append(
            {
                "length": length,
                "reprice_s": reprice_s,
                "plan_s": plan_s,
                "trace_there_s": there_s,
                "worst_relative_difference": _worst(priced, there),
                "same_split": firsts == firsts_there,
                "stage_starts": firsts,
                "stage_starts_traced_there": firsts_there,
                "bottleneck_ms": plan.bottleneck_ms,
                "bottleneck_ms_traced_there": plan_there.bottleneck_ms,
                "split_priced_there_bottleneck_ms": same.bottleneck_ms,
                "split_priced_there_peak_memory_gib": max(same.rank_memory_bytes) / 2**30,
                "peak_memory_gib": max(plan.rank_memory_bytes) / 2**30,
                "peak_memory_gib_traced_there": max(plan_there.rank_memory_bytes) / 2**30,
            }
        )
    result = {
        "model": "benchmarks/scale/llama.py build_70b, rotary tables sliced by the length",
        "traced_at": TRACED,
        "dynamic_trace_s": trace_s,
        "units": len(once.units),
        "rows": rows,
        "load_average": os.getloadavg()[0],
    }
    if os.environ.get("FXPIPE_70B_SIZE", "70b") == "70b":
        (HERE / "plan_70b.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"one dynamic meta trace at {TRACED}: {trace_s:.1f} s, {len(once.units)} units")
    print(
        "| length | re-price s | plan s | trace there s | FLOPs | fwd ms | bwd ms | activations"
        " | same 16-stage split | bottleneck ms: re-priced / traced there / the re-priced split on"
        " the trace there | peak GiB (the same three) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["worst_relative_difference"]
        print(
            f"| {r['length']} | {r['reprice_s']:.2f} | {r['plan_s']:.1f} | {r['trace_there_s']:.1f} | "
            f"{w['fwd_flops']:.1e} | {w['fwd_ms']:.1e} | {w['bwd_ms']:.1e} | {w['activation_bytes']:.1e} | "
            f"{r['same_split']} | {r['bottleneck_ms']:.1f} / {r['bottleneck_ms_traced_there']:.1f} / "
            f"{r['split_priced_there_bottleneck_ms']:.1f} | {r['peak_memory_gib']:.2f} / "
            f"{r['peak_memory_gib_traced_there']:.2f} / {r['split_priced_there_peak_memory_gib']:.2f} |"
        )
    return result


if __name__ == "__main__":
    main()
