"""Compiled stages: fxpipe compiled vs fxpipe eager vs torch.distributed.pipelining eager, same chunks.

    .venv/bin/python benchmarks/runtime/bench_compiled.py [--model gpt_medium|llama_medium]
        [--steps 15] [--out benchmarks/runtime] [--device cuda]

Design, fixed before the first run: gpt_medium (benchmarks/runtime/gpt_medium.py; or
llama_medium.py, a transformers Llama of its size and sequence), batch 16 in
M = 4 microbatches, 2 ranks, gloo on 127.0.0.1, CPU, one thread per rank. One trace (analytic
unit times), one plan per schedule (1F1B, interleaved 1F1B, ZB-H1, ZBV; V = 2 for the last two
placements): the same build (the same chunks) serves every variant of its schedule. One torchrun
job; per build, each variant loads its own copy of the rank's stages (``load_stage``):

- ``fxpipe eager``: ``PipelineRunner`` as today;
- ``fxpipe compiled``: ``PipelineRunner(compile="stage")``; on the 1F1B build also
  ``compile="regional"`` (the scope measurement of docs/compile.md); on the ZB-H1 and ZBV builds
  also ``compile="stage"`` with each region's backward cut into an input and a weight half
  (``compile_backward="halves"``, the default since this benchmark chose it: ``B`` runs the
  input half, ``W`` the weight half) beside one backward graph (``compile_backward="graph"``:
  ``B`` runs it whole, ``W`` accumulates: Note [compiled split backward]);
- ``peer eager``: the peer's schedule over ``PipelineStage`` wrappers of the same modules
  (``bench_schedules._peer``; the peer refuses torch.compile with its zero-bubble schedules).

Each compiled variant compiles into a fresh inductor cache folder (a cold compile; its seconds per
stage are the warm-up's, ``CompiledStage.seconds``). Then 3 untimed steps of every variant, then
``--steps`` rounds; in each round every variant runs one step, in a fixed order, each step between
two barriers. Reported per variant: the median over rounds of the slowest rank's step; for fxpipe
variants the per-step compute of B and W actions (the sum over the rank's actions, median over
rounds, the slower rank). Writes compiled.json and compiled.md, one table per model: a run of
one model keeps the other's latest table.

``--device cuda`` (one GPU): the same variants on one rank (NCCL, world size 1), each schedule
planned for one rank (1F1B and ZB-H1: one stage; interleaved 1F1B and ZBV: two stages on the
rank), each step between two ``torch.cuda.synchronize``; inputs and weights on the GPU, the
thread count left as it is. Writes compiled_cuda.json and compiled_cuda.md (``--device cpu
--ranks 1`` runs the same rows on the CPU: the script's own check, compiled_cpu.*).
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

MODELS = {"gpt_medium": HERE / "gpt_medium.py", "llama_medium": HERE / "llama_medium.py"}
RANKS, BATCH, M, LR = 2, 16, 4, 0.01
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")


def _build(root: Path, model: Path, ranks: int) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(model)
    traced = trace_model_file(source, BATCH // M, progress=False)
    for name in SCHEDULES:
        plan = plan_partition(traced.profile, ranks, microbatches=M, schedule=name)
        write_build_dir(traced, plan, root / name, source, batch_size=BATCH, microbatches=M)


def _work(fx, kind: str) -> float:
    return sum(a.end - a.start for a in fx.executor.last_step if a.action.kind.value == kind)


def _worker(root: Path, steps: int, raw_out: Path, model: Path, device: str) -> None:
    import torch.distributed as dist

    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    if device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rank = dist.get_rank()
    source = load_model_file(model)
    inputs = tuple(x.to(device) for x in source.example_inputs(BATCH))
    targets = source.example_targets(BATCH).to(device)
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
                device=device,
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
        steps_fn["peer eager"] = bs._peer(build, name, M, source, rank, device)
        variants["peer eager"] = {}
        for v in variants.values():
            v.update(times=[], B=[], W=[])
        for _ in range(3):
            for fn in steps_fn.values():
                fn()
        for _ in range(steps):
            for label, fn in steps_fn.items():
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                sync()
                dist.barrier()
                variants[label]["times"].append(time.perf_counter() - t0)
                if label in runners and device == "cpu":  # on a GPU the actions' spans are launches
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


def _markdown(runs: dict[str, dict], device: str = "cpu") -> str:
    first = next(iter(runs.values()))
    ranks = first.get("ranks", RANKS)
    where = f"{ranks} rank{'s' if ranks > 1 else ''}, {first.get('device_name', 'CPU')}"
    how = (
        "gloo on 127.0.0.1, one thread per rank"
        if device == "cpu"
        else "NCCL, each step between two torch.cuda.synchronize"
    )
    lines = [
        f"# Compiled stages (batch {BATCH} = {M} x {BATCH // M}, {where})",
        "",
        f"{how}, SGD; median over the rounds of the slowest "
        "rank's step, the variants alternating within each round, each step between barriers; the "
        "same build (chunks) for every variant of a schedule. B / W: a rank's compute in its B and "
        "in its W actions per step, each column the larger over the two ranks on its own (a first "
        "stage fed token ids has no input gradient: all its backward is W). Compile: cold (a fresh "
        "inductor cache), seconds per stage.",
    ]
    for model, run in runs.items():
        lines += [
            "",
            f"## {model} ({run['steps']} rounds, {run.get('date', 'date not recorded')}, torch "
            f"{run['torch']})",
            "",
            "| schedule | variant | step ms | / fxpipe eager | / peer eager | B ms | W ms | "
            "compile s per stage |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += _table(run["rows"])
    return "\n".join(lines) + "\n"


def _table(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        comp = ", ".join(f"{s}: {v:.0f}" for s, v in sorted(r["compile_s"].items())) or ""
        b = f"{r['B_ms']:.1f}" if r["B_ms"] is not None else ""
        w = f"{r['W_ms']:.1f}" if r["W_ms"] is not None else ""
        lines.append(
            f"| {r['schedule']} | {r['variant']} | {r['step_ms']:.1f} | {r['over_eager']:.2f} | "
            f"{r['over_peer']:.2f} | {b} | {w} | {comp} |"
        )
    return lines


def _latest_runs(path: Path) -> dict[str, dict]:
    """The models' latest runs in ``compiled.json`` (a file of one run, before there were two
    models, is gpt_medium's)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data["runs"] if "runs" in data else {data["model"]: data}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, steps, raw, model, device = sys.argv[2:7]
        _worker(Path(root), int(steps), Path(raw), Path(model), device)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=tuple(MODELS), default="gpt_medium")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ranks", type=int, default=None, help="default: 2 on the CPU, 1 on a GPU")
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="a quick check: fewer")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["FXPIPE_BENCH_SCHEDULES"] = args.schedules
    from launch_ranks import torchrun

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = MODELS[args.model]
        ranks = args.ranks or (RANKS if args.device == "cpu" else 1)
        _build(root, model, ranks)
        raw = root / "raw.json"
        subprocess.run(
            torchrun(
                __file__, ranks, str(root), str(args.steps), str(raw), str(model), args.device
            ),
            check=True,
        )
        data = json.loads(raw.read_text())
    result = {
        "model": args.model,
        "batch": BATCH,
        "microbatches": M,
        "steps": args.steps,
        "ranks": ranks,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "rows": _rows(data),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "compiled" if args.device == "cpu" and ranks == RANKS else f"compiled_{args.device}"
    runs = _latest_runs(args.out / f"{stem}.json")
    runs[args.model] = result
    runs = {name: runs[name] for name in MODELS if name in runs}
    (args.out / f"{stem}.json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(_markdown(runs, args.device))
    print(_markdown({args.model: result}, args.device))


if __name__ == "__main__":
    main()
