"""Compiled stages: fxpipe compiled vs fxpipe eager vs torch.distributed.pipelining eager, same chunks.

    .venv/bin/python benchmarks/runtime/bench_compiled.py [--steps 15] [--out benchmarks/runtime]

Design, fixed before the first run: gpt_medium (benchmarks/runtime/gpt_medium.py), batch 16 in
M = 4 microbatches, 2 ranks, gloo on 127.0.0.1, CPU, one thread per rank. One trace (analytic
unit times), one plan per schedule (1F1B, interleaved 1F1B, ZB-H1, ZBV; V = 2 for the last two
placements): the same build (the same chunks) serves every variant of its schedule. One torchrun
job; per build, each variant loads its own copy of the rank's stages (``load_stage``):

- ``fxpipe eager``: ``PipelineRunner`` as today;
- ``fxpipe compiled``: ``PipelineRunner(compile="stage")``; on the 1F1B build also
  ``compile="regional"`` (the scope measurement of docs/compile.md); on the ZB-H1 and ZBV builds
  also ``compile="stage"`` with each region's backward cut into an input and a weight half
  (``compile_backward="halves"``: ``B`` runs the input half, ``W`` the weight half) beside the
  default one backward graph (``B`` runs it whole, ``W`` accumulates: Note [compiled split
  backward]);
- ``peer eager``: the peer's schedule over ``PipelineStage`` wrappers of the same modules
  (``bench_schedules._peer``; the peer refuses torch.compile with its zero-bubble schedules).

Each compiled variant compiles into a fresh inductor cache folder (a cold compile; its seconds per
stage are the warm-up's, ``CompiledStage.seconds``). Then 3 untimed steps of every variant, then
``--steps`` rounds; in each round every variant runs one step, in a fixed order, each step between
two barriers. Reported per variant: the median over rounds of the slowest rank's step; for fxpipe
variants the per-step compute of B and W actions (the sum over the rank's actions, median over
rounds, the slower rank). Writes compiled.json and compiled.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import bench_schedules as bs  # noqa: E402

MODEL = HERE / "gpt_medium.py"
RANKS, BATCH, M, LR = 2, 16, 4, 0.01
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")


def _build(root: Path) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(MODEL)
    traced = trace_model_file(source, BATCH // M, progress=False)
    for name in SCHEDULES:
        plan = plan_partition(traced.profile, RANKS, microbatches=M, schedule=name)
        write_build_dir(traced, plan, root / name, source, batch_size=BATCH, microbatches=M)


def _work(fx, kind: str) -> float:
    return sum(a.end - a.start for a in fx.executor.last_step if a.action.kind.value == kind)


def _worker(root: Path, steps: int, raw_out: Path) -> None:
    import torch.distributed as dist

    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = load_model_file(MODEL)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    out: dict = {}
    for name in os.environ.get("FXPIPE_BENCH_SCHEDULES", ",".join(SCHEDULES)).split(","):
        build = root / name
        variants: dict = {}
        runners = {}
        scopes: list = [False, "stage"] + (["regional"] if name == "1f1b" else [])
        if name in ("zb-h1", "zbv"):  # Note [compiled split backward]: the backward in halves
            scopes.append("stage, backward halves")
        for scope in scopes:
            label = f"fxpipe compiled ({scope})" if scope else "fxpipe eager"
            halves = scope == "stage, backward halves"
            start = time.perf_counter()
            fx = PipelineRunner(
                build,
                source.loss_fn,
                microbatches=M,
                optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
                compile="stage" if halves else scope,
                compile_backward="halves" if halves else "graph",
                compile_cache=root / f"cache-{name}-{len(runners)}",
                timeout_s=1800,
            )
            runners[label] = fx
            variants[label] = {
                "compile_s": {c.stage: c.seconds for c in fx.compiled},
                "setup_s": time.perf_counter() - start,
                "graph_breaks": {c.stage: c.graph_breaks for c in fx.compiled},
            }
        steps_fn = {
            label: (lambda fx=fx: fx.step(inputs, targets)) for label, fx in runners.items()
        }
        steps_fn["peer eager"] = bs._peer(build, name, M, source, rank)
        variants["peer eager"] = {}
        for v in variants.values():
            v.update(times=[], B=[], W=[])
        for _ in range(3):
            for fn in steps_fn.values():
                fn()
        for _ in range(steps):
            for label, fn in steps_fn.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                variants[label]["times"].append(time.perf_counter() - t0)
                if label in runners:
                    variants[label]["B"].append(_work(runners[label], "B"))
                    variants[label]["W"].append(_work(runners[label], "W"))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, variants)
        out[name] = gathered
    if rank == 0:
        raw_out.write_text(json.dumps(out))
    dist.destroy_process_group()


def _rows(raw: dict) -> list[dict]:
    rows = []
    for name in raw:
        per_rank = raw[name]
        eager = max(statistics.median(r["fxpipe eager"]["times"]) for r in per_rank) * 1e3
        peer = max(statistics.median(r["peer eager"]["times"]) for r in per_rank) * 1e3
        for label in per_rank[0]:
            step = max(statistics.median(r[label]["times"]) for r in per_rank) * 1e3
            compile_s = {}
            for r in per_rank:
                compile_s.update(r[label].get("compile_s", {}))
            b = (
                max(statistics.median(r[label]["B"]) for r in per_rank) * 1e3
                if per_rank[0][label].get("B")
                else None
            )
            w = (
                max(statistics.median(r[label]["W"]) for r in per_rank) * 1e3
                if per_rank[0][label].get("W")
                else None
            )
            rows.append(
                {
                    "schedule": name,
                    "variant": label,
                    "step_ms": step,
                    "over_eager": step / eager,
                    "over_peer": step / peer,
                    "B_ms": b,
                    "W_ms": w,
                    "compile_s": {int(k): v for k, v in compile_s.items()},
                    "graph_breaks": sum(
                        len(x) for r in per_rank for x in r[label].get("graph_breaks", {}).values()
                    ),
                }
            )
    return rows


def _markdown(rows: list[dict], steps: int) -> str:
    lines = [
        f"# Compiled stages (gpt_medium, batch {BATCH} = {M} x {BATCH // M}, {RANKS} ranks, CPU)",
        "",
        f"gloo on 127.0.0.1, one thread per rank, SGD; median over {steps} rounds of the slowest "
        "rank's step, the variants alternating within each round, each step between barriers; the "
        "same build (chunks) for every variant of a schedule. B / W: a rank's compute in its B and "
        "in its W actions per step, each column the larger over the two ranks on its own (a first "
        "stage fed token ids has no input gradient: all its backward is W). Compile: cold (a fresh "
        "inductor cache), seconds per stage.",
        "",
        "| schedule | variant | step ms | / fxpipe eager | / peer eager | B ms | W ms | compile s per stage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        comp = ", ".join(f"{s}: {v:.0f}" for s, v in sorted(r["compile_s"].items())) or ""
        b = f"{r['B_ms']:.1f}" if r["B_ms"] is not None else ""
        w = f"{r['W_ms']:.1f}" if r["W_ms"] is not None else ""
        lines.append(
            f"| {r['schedule']} | {r['variant']} | {r['step_ms']:.1f} | {r['over_eager']:.2f} | "
            f"{r['over_peer']:.2f} | {b} | {w} | {comp} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="a quick check: fewer")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["FXPIPE_BENCH_SCHEDULES"] = args.schedules
    from launch_ranks import torchrun

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _build(root)
        raw = root / "raw.json"
        subprocess.run(
            torchrun(__file__, RANKS, str(root), str(args.steps), str(raw)),
            check=True,
        )
        data = json.loads(raw.read_text())
    rows = _rows(data)
    result = {
        "model": "gpt_medium",
        "batch": BATCH,
        "microbatches": M,
        "steps": args.steps,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "compiled.md").write_text(_markdown(rows, args.steps))
    print(_markdown(rows, args.steps))


if __name__ == "__main__":
    main()
