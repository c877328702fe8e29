"""What activation recomputation costs beyond the forward it repeats: the step model's recompute terms.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/recompute_cost.py [--repeats 40] [--out benchmarks/prediction]

Runs the transformer blocks of examples/gpt.py and benchmarks/runtime/gpt_medium.py (one
thread, as a torchrun rank), 1, 2 and 4 blocks as one region at two microbatch sizes,
forward and forward + backward, plainly and under one non-reentrant
``torch.utils.checkpoint`` region (what a recomputing stage runs), alternating so load
changes hit both alike. For each it counts the tensors autograd saves (what the profile's
``Unit.saved_tensors`` counts) and reports the region's extra forward time (``F``) and the
extra backward time beyond one repeated forward (``B``), then fits both as a fixed cost per
region plus a cost per saved tensor, next to ``RUNTIME_COSTS["cpu"]``'s
``recompute_*`` terms (Note [recompute cost]). Writes recompute_cost.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "gpt": (ROOT / "examples", "gpt", (2, 8)),
    "gpt_medium": (ROOT / "benchmarks" / "runtime", "gpt_medium", (1, 4)),
}
BLOCKS = (1, 2, 4)


def _measure(blocks: Any, x0: Any, repeats: int) -> dict[str, float]:
    """Median ms of forward (f), forward + backward (fb), and both under checkpoint (cf, cfb)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    times: dict[str, list[float]] = {k: [] for k in ("f", "fb", "cf", "cfb")}
    for i in range(repeats + 5):
        for kind in times:
            x = x0.clone().requires_grad_(True)
            t0 = time.perf_counter()
            y = checkpoint(blocks, x, use_reentrant=False) if kind.startswith("c") else blocks(x)
            if kind.endswith("b"):
                y.backward(torch.ones_like(y))
            if i >= 5:
                times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _saved(blocks: Any, x0: Any) -> int:
    import torch

    count = 0

    def pack(t: Any) -> Any:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        blocks(x0.clone().requires_grad_(True))
    return count


def _fit(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Least squares ``key ~ fixed + per_saved x saved``: (fixed ms, per saved tensor ms)."""
    xs, ys = [r["saved"] for r in rows], [r[key] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    import torch

    from fxpipe.partitioner.prediction import RUNTIME_COSTS

    torch.set_num_threads(1)
    rows = []
    for name, (folder, module, microbatches) in CASES.items():
        sys.path.insert(0, str(folder))
        src = __import__(module)
        model = src.build_model()
        for mb in microbatches:
            x0 = model.wte(src.example_inputs(mb)[0]).detach()
            for n in BLOCKS:
                blocks = torch.nn.Sequential(*model.blocks[:n])
                t = _measure(blocks, x0, args.repeats)
                row = {
                    "model": name,
                    "microbatch": mb,
                    "blocks": n,
                    "saved": _saved(blocks, x0),
                    **t,
                    "region_f": t["cf"] - t["f"],
                    "region_b": (t["cfb"] - t["cf"]) - (t["fb"] - t["f"]) - t["f"],
                }
                rows.append(row)
                print(
                    f"{name} mb {mb} blocks {n}: saved {row['saved']}, forward {t['f']:.3f} ms, "
                    f"region F +{row['region_f']:.3f}, B beyond a forward +{row['region_b']:.3f}",
                    flush=True,
                )
    cpu = RUNTIME_COSTS["cpu"]
    groups = {"all": rows, **{name: [r for r in rows if r["model"] == name] for name in CASES}}
    fits = {g: {"F": _fit(rs, "region_f"), "B": _fit(rs, "region_b")} for g, rs in groups.items()}
    model_terms = {
        "F": (cpu.recompute_fwd_ms, cpu.recompute_fwd_saved_ms),
        "B": (cpu.recompute_bwd_ms, cpu.recompute_bwd_saved_ms),
    }
    lines = [
        "# Recompute cost: one checkpoint region against the forward it repeats",
        "",
        f"One thread, median of {args.repeats} alternating runs. 'F': the region's forward minus the plain "
        "forward; 'B': its backward minus the plain backward minus one forward (the recomputation the "
        "stage costs already charge). Predicted: RUNTIME_COSTS['cpu'] (fixed + per saved tensor).",
        "",
        "| model | microbatch | blocks | saved tensors | forward ms | backward ms | F measured | F predicted "
        "| B measured | B predicted | region / forward |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pf = cpu.recompute_fwd_ms + r["saved"] * cpu.recompute_fwd_saved_ms
        pb = cpu.recompute_bwd_ms + r["saved"] * cpu.recompute_bwd_saved_ms
        lines.append(
            f"| {r['model']} | {r['microbatch']} | {r['blocks']} | {r['saved']} | {r['f']:.3f} | "
            f"{r['fb'] - r['f']:.3f} | {r['region_f']:.3f} | {pf:.3f} | {r['region_b']:.3f} | {pb:.3f} | "
            f"{(r['cfb'] - r['fb']) / r['f']:.2f} |"
        )
    lines += [
        "",
        "| rows | action | fitted fixed ms | fitted ms per saved tensor | RUNTIME_COSTS fixed | per saved |",
        "|---|---|---|---|---|---|",
    ]
    for g in groups:
        for k in ("F", "B"):
            lines.append(
                f"| {g} | {k} | {fits[g][k][0]:.3f} | {fits[g][k][1]:.4f} | {model_terms[k][0]:.3f} | "
                f"{model_terms[k][1]:.4f} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recompute_cost.md").write_text("\n".join(lines) + "\n")
    (args.out / "recompute_cost.json").write_text(
        json.dumps({"rows": rows, "fits": fits}, indent=1) + "\n"
    )
    print("\n".join(lines[-8:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
