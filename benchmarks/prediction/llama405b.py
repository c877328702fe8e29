"""On paper: the cluster search with tensor parallelism for Llama 3.1 405B on 512 H100, beside torchtitan's published layout.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/llama405b.py [--out benchmarks/prediction]

torchtitan (benchmarks/llama3_h100_202412_torchtitan.md, Table 5): Llama 3.1 405B on 512
H100 as FSDP 8 x TP 8 x PP 8, local batch 32, global batch 256 sequences of 8192 tokens,
full activation checkpointing, torch.compile + Float8 + AsyncTP: 100 tokens/s/GPU with 1F1B
(82.5 GiB), 128 with interleaved 1F1B (72.7 GiB); their H100s have 96 GB of HBM2e at 500 W.

Here (the analytic profile the cluster benchmarks use, ``transformer_profile``: 126 blocks,
hidden 16384, SwiGLU 53248, 128 heads (8 KV), vocabulary 128256, 8192-token sequences,
400 TFLOP/s effective per device, Adam; a block is one unit whose attention and MLP
linears split column / row as the runtime's plan splits a Llama):

1. ``search_tensor_parallel`` on 512 devices of 80 GiB, 8 per node (NVLink inside,
   InfiniBand between), global batch 256: every degree T in {1, 2, 4, 8}, its best layout
   and predicted step, and tokens/s/GPU = 256 x 8192 / step / 512.
2. torchtitan's layout priced by the same simulator (first): tp 8 (the profile as one rank
   of a tp group of 8 on NVLink), then 8 pipeline ranks x 8 replicas, microbatch 1 (32
   microbatches per replica), FSDP full sharding, with 1F1B and with interleaved 1F1B at
   V = 2 (the table does not say V), recomputation where the pricer needs it to fit; on
   80 GiB devices (the issue's cluster) and on 96 GB (torchtitan's, whose 1F1B run read
   82.5 GiB); FSDP as fxpipe's ``full`` level (parameters gathered and gradients
   reduce-scattered per microbatch) and as ``grad-op`` (once per step: what FSDP does under
   torch's pipeline schedules, which keep parameters unsharded between microbatches and
   sync gradients at the last one; grad-op keeps the parameters whole, so its memory is an
   upper bound); each with fxpipe's default fp32 gathers and as torchtitan's job runs (bf16
   autocast, FSDP gathering bf16 parameters and reducing in fp32: ``cost_fields``). The TP
   search (1.) is priced as torchtitan's job.
3. The simulator's interleaved / 1F1B ratio (each sharding and memory where both fit) against the published 128 / 100 = 1.28, and the
   bubbles' textbook ratio (m + p - 1) / (m + (p - 1) / V) for p = 8, m = 32.
Writes llama405b.json and llama405b.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

SEQ, BATCH, DEVICES, TP = 8192, 256, 512, 8
# torchtitan's job: bf16 mixed precision, FSDP gathering bf16 parameters and reducing in fp32
# (its MixedPrecisionPolicy); fp32 gathers are fxpipe's default for comparison
BF16 = {"precision": "bf16", "shard_param_dtype": "bfloat16", "shard_reduce_dtype": "float32"}
FP32: dict[str, str] = {}
PUBLISHED = {"1f1b": 100.0, "interleaved-1f1b": 128.0}


def llama405b() -> Any:
    from fxpipe.partitioner.synthetic import transformer_profile

    return transformer_profile(
        layers=126,
        hidden=16384,
        ffn=53248,
        heads=128,
        kv_heads=8,
        vocab=128256,
        seq=SEQ,
        name="llama3.1-405b (synthetic)",
    )


def styles(layers: int) -> dict[str, str]:
    """The runtime's plan for a Llama block: q, k, v and the MLP's w1, w3 colwise, o and w2 rowwise."""
    out = {}
    for i in range(layers):
        for name, style in (
            ("attn.wq", "colwise"),
            ("attn.wk", "colwise"),
            ("attn.wv", "colwise"),
            ("attn.wo", "rowwise"),
            ("mlp.w1", "colwise"),
            ("mlp.w3", "colwise"),
            ("mlp.w2", "rowwise"),
        ):
            out[f"layers.{i}.{name}"] = style
    return out


def tokens_per_gpu(step_ms: float) -> float:
    return BATCH * SEQ / (step_ms / 1e3) / DEVICES


def _score(s: Any) -> dict[str, Any]:
    return {
        "config": s.config.label,
        "step_s": s.step_ms / 1e3,
        "tokens_per_s_per_gpu": tokens_per_gpu(s.step_ms),
        "bubble": s.bubble,
        "memory_gib": s.peak_memory_bytes / 2**30,
        "limit": s.limit,
        "recomputing_stages": sum(s.config.recompute),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    from fxpipe.errors import InfeasibleError
    from fxpipe.partitioner.cluster import ClusterSpec
    from fxpipe.partitioner.prediction import runtime_costs_for
    from fxpipe.partitioner.search.configurations import search_configurations
    from fxpipe.partitioner.search.tensor_parallel import search_tensor_parallel
    from fxpipe.partitioner.tensor_parallel import tensor_parallel_profile

    profile = llama405b()
    plan = styles(126)
    cluster = ClusterSpec(devices=DEVICES, device_memory=80 * 2**30, node_size=8)
    # torchtitan's layout: tp 8 inside a node, 8 x 8 groups of 8, on 80 GiB and on its own
    # 96 GB devices
    runtime = runtime_costs_for(profile.trace_device, profile.host_slowdown)
    assert cluster.intra_bandwidth is not None and cluster.intra_latency is not None
    priced = tensor_parallel_profile(
        profile,
        plan,
        TP,
        cluster.intra_bandwidth,
        cluster.intra_latency,
        (runtime.tp_pair_fwd_ms, runtime.tp_pair_bwd_ms),
    )
    titan: dict[str, Any] = {}
    for shard, memory_name, memory, job in (
        ("full", "80 GiB", 80 * 2**30, FP32),
        ("full", "96 GB", 96 * 10**9, FP32),
        ("grad-op", "96 GB", 96 * 10**9, FP32),
        ("full", "96 GB", 96 * 10**9, BF16),
        ("grad-op", "96 GB", 96 * 10**9, BF16),
    ):
        groups = replace(cluster, devices=DEVICES // TP, node_size=1, device_memory=memory)
        gathers = "bf16 gathers" if job else "fp32 gathers"
        for schedule in ("1f1b", "interleaved-1f1b"):
            key = f"{schedule}, shard {shard}, {gathers}, {memory_name}"
            try:
                found = search_configurations(
                    priced,
                    groups,
                    BATCH,
                    optimizer="adam",
                    schedules=(schedule,),
                    shard_levels=(shard,),
                    stages=8,
                    top=40,
                    cost_fields=job,
                )
            except InfeasibleError as exc:
                titan[key] = {"does_not_fit": str(exc)}
                continue
            match = [
                s
                for s in found.ranked
                if s.config.replicas == 8
                and s.config.microbatch_size == 1
                and s.config.virtual_stages == (2 if schedule != "1f1b" else 1)
            ]
            titan[key] = _score(match[0]) if match else None
            print(key, titan[key], flush=True)
    started = time.perf_counter()
    best, outcomes = search_tensor_parallel(
        profile,
        cluster,
        BATCH,
        {2: plan, 4: plan, 8: plan},
        (1, 2, 4, 8),
        top=1,
        optimizer="adam",
        cost_fields=BF16,
    )
    search_s = time.perf_counter() - started
    degrees = [
        {
            "tp": o.degree,
            "note": o.note,
            "best": _score(o.result.best) if o.result is not None else None,
        }
        for o in outcomes
    ]
    one = titan.get("1f1b, shard full, fp32 gathers, 96 GB")
    two = titan.get("interleaved-1f1b, shard full, fp32 gathers, 96 GB")
    ratio = (
        one["step_s"] / two["step_s"]
        if one and two and "step_s" in one and "step_s" in two
        else None
    )
    m, pp, v = BATCH // 8, 8, 2
    result = {
        "search_seconds": search_s,
        "search_job": BF16,
        "degrees": degrees,
        "best_tp": best.degree,
        "torchtitan_layout": titan,
        "simulated_interleaved_over_1f1b": ratio,
        "published_interleaved_over_1f1b": PUBLISHED["interleaved-1f1b"] / PUBLISHED["1f1b"],
        "textbook_bubble_ratio": (m + pp - 1) / (m + (pp - 1) / v),
        "published_tokens_per_s_per_gpu": PUBLISHED,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama405b.json").write_text(json.dumps(result, indent=1) + "\n")
    md = _markdown(result)
    (args.out / "llama405b.md").write_text(md)
    print(md)
    return 0


def _markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Llama 3.1 405B on 512 H100: the search with TP, and torchtitan's layout, on paper",
        "",
        "Analytic profile (126 blocks, 8192-token sequences, 400 TFLOP/s effective per device, "
        "Adam), 512 devices of 80 GiB, 8 per node (NVLink, InfiniBand), global batch 256; "
        "tokens/s/GPU = 256 x 8192 / step / 512. "
        f"The search over T in 1, 2, 4, 8 took {r['search_seconds']:.0f} s, priced as torchtitan's "
        "job: bf16 autocast, FSDP gathering bf16 parameters and reducing in fp32.",
        "",
        "## The search's answer, per tensor-parallel degree",
        "",
        "| tp | layout (per group of T) | step s | tokens/s/GPU | bubble | GiB per device | "
        "recomputing stages | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in r["degrees"]:
        b = d["best"]
        if b is None:
            lines.append(f"| {d['tp']} | - | - | - | - | - | - | {d['note']} |")
            continue
        lines.append(
            f"| {d['tp']} | {b['config']} | {b['step_s']:.1f} | {b['tokens_per_s_per_gpu']:.0f} | "
            f"{b['bubble']:.2f} | {b['memory_gib']:.1f} | {b['recomputing_stages']} | {d['note']} |"
        )
    lines += [
        "",
        "## torchtitan's layout (FSDP 8 x TP 8 x PP 8, microbatch 1) in the simulator",
        "",
        "| schedule | simulated layout | step s | simulated tokens/s/GPU | published | "
        "GiB per device | recomputing stages |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, s in r["torchtitan_layout"].items():
        schedule = key.split(",")[0]
        pub = r["published_tokens_per_s_per_gpu"][schedule]
        if s is None or "does_not_fit" in s:
            why = "not priced" if s is None else s["does_not_fit"]
            lines.append(f"| {key} | {why} | - | - | {pub:.0f} | - | - |")
            continue
        lines.append(
            f"| {key} | {s['config']} | {s['step_s']:.1f} | {s['tokens_per_s_per_gpu']:.0f} "
            f"| {pub:.0f} | {s['memory_gib']:.1f} | {s['recomputing_stages']} |"
        )
    ratios = []
    for key, one in r["torchtitan_layout"].items():
        if not key.startswith("1f1b,"):
            continue
        two = r["torchtitan_layout"].get("interleaved-1f1b" + key[len("1f1b") :])
        if one and two and "step_s" in one and "step_s" in two:
            ratios.append(
                f"{one['step_s'] / two['step_s']:.3f} ({key[len('1f1b, ') :]}; bubble "
                f"{one['bubble']:.2f} -> {two['bubble']:.2f})"
            )
    lines += [
        "",
        f"Interleaved / 1F1B step: simulated {'; '.join(ratios) or 'n/a (no pair fits)'}; "
        f"published {r['published_interleaved_over_1f1b']:.2f}; the bubbles' textbook ratio "
        f"(m + p - 1) / (m + (p - 1) / V) at p 8, m 32, V 2: {r['textbook_bubble_ratio']:.3f}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
