"""One compiled stage's split backward: one backward graph vs input and weight halves, alternating.

    .venv/bin/python benchmarks/runtime/bench_split_halves.py [--rounds 15] [--model gpt_medium]
        [--device cpu|cuda]

Design, fixed before the first run: the model's 2-stage ZB-H1 build (analytic CPU trace), the
stage fed activations (stage 1, the loss stage) loaded three times, one thread, on the CPU (or one
GPU, ``--device cuda``: the issue's F, I and W microbenchmark; each action timed between two
``torch.cuda.synchronize``): ``eager``;
``compile_module(..., split_graphs=False)`` (each region's backward one compiled graph: ``B``
runs it whole and keeps the weight gradients, ``W`` accumulates them); ``split_graphs=True``
(``B`` runs the input half, ``W`` the weight half: Note [compiled split backward]). One round:
per variant in turn, M microbatches of F, then B (``backward_inputs``) and W
(``backward_weights``) per microbatch, as a zero-bubble schedule runs them; each action timed.
After 3 untimed rounds, the median over ``--rounds`` rounds of each variant's F, B, W and
F + B + W per round (M microbatches). Prints a table and writes split_halves.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODELS = {
    "gpt_medium": (HERE / "gpt_medium.py", 16, 4),
    "gpt": (ROOT / "examples" / "gpt.py", 8, 4),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--model", default="gpt_medium", choices=sorted(MODELS))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    from fxpipe.codegen import load_stage, write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.runtime.pipeline.compiled import compile_module, use_cache_dir
    from fxpipe.tracer import trace_model_file

    path, batch, m = MODELS[args.model]
    source = load_model_file(path)
    tmp = Path(tempfile.mkdtemp(prefix="split_halves-"))
    traced = trace_model_file(source, batch // m, progress=False)
    plan = plan_partition(traced.profile, 2, microbatches=m, schedule="zb-h1")
    write_build_dir(traced, plan, tmp / "b", source, batch_size=batch, microbatches=m)
    use_cache_dir(tmp / "cache", explicit=True)  # a cold compile
    first = load_stage(tmp / "b", 0, device=device)
    stage = load_stage(tmp / "b", 1, device=device)
    chunks = [c for c in zip(*(t.to(device).chunk(m) for t in source.example_inputs(batch)))]
    targets = source.example_targets(batch).to(device).chunk(m)
    with torch.no_grad():
        acts = [first(*c) for c in chunks]
    acts = [a if isinstance(a, tuple) else (a,) for a in acts]
    variants = {"eager": stage}
    compile_s = {}
    for label, split in (("compiled, one backward graph", False), ("compiled, split halves", True)):
        mod = copy.deepcopy(stage)
        compile_module(mod, "stage", [0] * len(acts[0]), stage=1, split_graphs=split)
        start = time.perf_counter()
        for _ in range(2):  # compile (fused backward, then the split path once)
            _round(mod, acts, targets, source.loss_fn, sync)
        compile_s[label] = time.perf_counter() - start
        variants[label] = mod
    times: dict[str, dict[str, list[float]]] = {
        k: {"F": [], "B": [], "W": [], "all": []} for k in variants
    }
    for r in range(3 + args.rounds):
        for label, mod in variants.items():
            f, b, w = _round(mod, acts, targets, source.loss_fn, sync)
            if r >= 3:
                for k, v in (("F", f), ("B", b), ("W", w), ("all", f + b + w)):
                    times[label][k].append(v)
    med = {k: {x: statistics.median(v) * 1e3 for x, v in t.items()} for k, t in times.items()}
    base = med["compiled, one backward graph"]
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, 1 thread"
    print(f"{args.model}, stage 1 of a 2-stage zb-h1 build, {m} microbatches, {where}")
    print(f"median over {args.rounds} rounds, variants alternating; ms per round (M microbatches)")
    print("| variant | F | B | W | F+B+W | / one graph (F+B+W) | B / one graph |")
    print("|---|---|---|---|---|---|---|")
    for label, v in med.items():
        print(
            f"| {label} | {v['F']:.1f} | {v['B']:.1f} | {v['W']:.1f} | {v['all']:.1f} | "
            f"{v['all'] / base['all']:.2f} | {v['B'] / base['B']:.2f} |"
        )
    print("compile + first rounds, s:", {k: round(v, 1) for k, v in compile_s.items()})
    if args.out is not None:
        result = {"device": where, "median_ms": med, "compile_s": compile_s}
        args.out.write_text(json.dumps(result, indent=1))


def _round(mod, acts, targets, loss_fn, sync):  # noqa: ANN001, ANN202
    from fxpipe.runtime.pipeline.split_backward import backward_inputs, backward_weights

    params = [p for p in mod.parameters() if p.requires_grad]
    f = b = w = 0.0
    pending = []
    for a, t in zip(acts, targets):
        x = [v.detach().requires_grad_(v.is_floating_point()) for v in a]
        sync()
        t0 = time.perf_counter()
        out = mod(*x)
        loss = loss_fn(out[0] if isinstance(out, tuple) else out, t)
        sync()
        f += time.perf_counter() - t0
        pending.append((loss, [v for v in x if v.requires_grad]))
    for loss, x in pending:
        t0 = time.perf_counter()
        _, work = backward_inputs([loss], [torch.ones_like(loss)], x, params)
        sync()
        t1 = time.perf_counter()
        backward_weights(work)
        sync()
        t2 = time.perf_counter()
        b += t1 - t0
        w += t2 - t1
    for p in params:
        p.grad = None
    return f, b, w


if __name__ == "__main__":
    sys.exit(main())
