"""The planner's CUDA figures against one GPU: unit times, step time and peak memory.

    python benchmarks/prediction/one_gpu.py [--steps 20] [--models gpt,gpt_medium,gpt_wide] [--out DIR]

One GPU runs no multi-rank NCCL pipeline, so this checks what one rank can: for each model
x timing mode (the analytic CUDA estimate, ``--cost-device cuda``; unit times and memory
measured on the GPU, ``--trace-device cuda --measure-times --measure-memory``) and layout
(1 stage, GPipe; 2 stages on 1 rank, interleaved 1F1B, which runs both stages' actions in
one process), it traces on the GPU, plans, writes the build and trains ``--steps`` SGD
steps with ``run_build`` on CUDA (NCCL, world size 1). Recorded: the median step (first
excluded) against ``plan.prediction.step_ms[schedule]``, the rank's peak CUDA memory
(``torch.cuda.max_memory_allocated`` over one extra step) against the walked peak, and the
fixed cost of calling a unit on the GPU (``call_overhead_ms``, Note [unit call cost]).
The tiny models are launch-bound on a GPU, ``gpt_wide`` is compute-bound.
``--repredict`` (no GPU needed): new predictions of the analytic rows of a saved
one_gpu.json (traced on the CPU, priced by the CUDA preset, Note [analytic unit time]) beside
the same measurements; the measured rows keep theirs (their unit times came from the GPU).
Writes one_gpu.json and one_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS: dict[str, tuple[Path, int, int]] = {  # name: (model file, batch size, microbatches)
    "gpt": (ROOT / "examples" / "gpt.py", 8, 4),
    "gpt_medium": (ROOT / "benchmarks" / "runtime" / "gpt_medium.py", 16, 4),
    "gpt_wide": (ROOT / "benchmarks" / "prediction" / "gpt_wide.py", 16, 4),
}
LAYOUTS = (
    ("1 stage", 1, "gpipe"),
    ("2 stages on 1 rank", 1, "interleaved-1f1b"),
)  # (label, ranks, schedule)
TIMINGS = ("analytic", "measured")
GOAL = (0.80, 1.33)  # prediction within 25% of the measurement


def _trace(name: str, **options: Any) -> tuple[Any, Any]:
    """The model file of ``name`` and its trace at its microbatch size."""
    from fxpipe.modelfile import load_model_file
    from fxpipe.tracer import trace_model_file

    model_file, batch, micro = MODELS[name]
    source = load_model_file(model_file)
    with warnings.catch_warnings():  # the GPTs' attention is kept as a leaf, with a warning
        warnings.simplefilter("ignore")
        return source, trace_model_file(source, batch // micro, progress=False, **options)


def _predicted(
    plan: Any, schedule: str, units: Any, measured_step_ms: float, measured_memory: list[int]
) -> dict[str, Any]:
    """A row's prediction fields: ``plan``'s step and memory for ``schedule`` against the measurement."""
    assert plan.prediction is not None
    predicted = plan.prediction.step_ms[schedule]
    memory = list(plan.prediction.peak_memory_bytes_by_schedule[schedule])
    return {
        "unit_ms": sum(u.fwd_ms + u.bwd_ms for u in units),
        "predicted_step_ms": predicted,
        "ratio": measured_step_ms / predicted,
        "predicted_pipeline_ms": plan.prediction.pipeline_ms[schedule],
        "predicted_step_overhead_ms": plan.prediction.step_overhead_ms.total_ms,
        "predicted_rank_memory_bytes": memory,
        "memory_ratio": [m / p for m, p in zip(measured_memory, memory)],
        "within_goal": GOAL[0] <= measured_step_ms / predicted <= GOAL[1],
    }


def _row(
    name: str, timing: str, layout: tuple[str, int, str], steps: int, builds: Path, device: str
) -> dict[str, Any]:
    from fxpipe.codegen import write_build_dir
    from fxpipe.partitioner import plan_partition
    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.train.run_options import RunOptions

    label, ranks, schedule = layout
    _, batch, micro = MODELS[name]
    measured = timing == "measured"
    source, traced = _trace(
        name,
        trace_device=device,
        measure_times=measured,
        measure_memory=measured and device == "cuda",
    )
    plan = plan_partition(traced.profile, ranks, schedule=schedule, microbatches=micro)
    build = builds / f"{name}-{timing}-{schedule}"
    write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
    run = run_build(
        build,
        RunOptions(
            steps=steps, schedule=schedule, microbatches=micro, batch_size=batch, device=device
        ),
        quiet=True,
    )
    return {
        "model": name,
        "timing": timing,
        "layout": label,
        "schedule": schedule,
        "stages": plan.num_stages,
        "batch_size": batch,
        "microbatches": micro,
        "measured_step_ms": run.median_step_ms,
        "measured_peak_cuda_bytes": list(run.peak_tensor_bytes),
        **_predicted(
            plan, schedule, traced.profile.units, run.median_step_ms, list(run.peak_tensor_bytes)
        ),
    }


def _repredicted(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` (an analytic one) with the current model's prediction for its measurement."""
    from fxpipe.partitioner import plan_partition

    _, traced = _trace(row["model"], cost_device="cuda")
    assert (
        traced.profile.trace_device == "cuda"
    )  # the profile names its cost device: planned with CUDA's runtime costs
    ranks = {label: r for label, r, _ in LAYOUTS}[row["layout"]]
    plan = plan_partition(
        traced.profile, ranks, schedule=row["schedule"], microbatches=row["microbatches"]
    )
    return {
        **row,
        **_predicted(
            plan,
            row["schedule"],
            traced.profile.units,
            row["measured_step_ms"],
            row["measured_peak_cuda_bytes"],
        ),
        "repredicted": True,
    }


def _markdown(result: dict[str, Any]) -> str:
    mib = 2**20
    env = result["environment"]
    lines = [
        "# One-GPU prediction results",
        "",
        f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}; SGD, {result['steps']} steps, median step "
        "excluding the first; ratio = measured / predicted, goal "
        f"{result['goal_ratio'][0]}-{result['goal_ratio'][1]}. Memory: the rank's peak CUDA allocation over "
        "one extra step against the plan's walked peak. Fixed cost of calling a unit on this GPU "
        f"(`call_overhead_ms`): forward {result['call_overhead_ms'][0]:.3f} ms, backward "
        f"{result['call_overhead_ms'][1]:.3f} ms.",
        "",
        "| model | batch = M x mb | timing | layout | unit ms (sum) | measured ms | predicted ms | ratio | "
        "in goal | memory MiB measured / predicted | memory ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        memory = ", ".join(
            f"{m / mib:.1f} / {p / mib:.1f}"
            for m, p in zip(r["measured_peak_cuda_bytes"], r["predicted_rank_memory_bytes"])
        )
        lines.append(
            f"| {r['model']} | {r['batch_size']} = {r['microbatches']} x "
            f"{r['batch_size'] // r['microbatches']} | {r['timing']} | {r['layout']} ({r['schedule']}) | "
            f"{r['unit_ms']:.2f} | {r['measured_step_ms']:.2f} | {r['predicted_step_ms']:.2f} | "
            f"{r['ratio']:.2f} | {'yes' if r['within_goal'] else 'NO'} | {memory} | "
            f"{', '.join(f'{x:.2f}' for x in r['memory_ratio'])} |"
        )
    inside = sum(r["within_goal"] for r in result["rows"])
    lines += [
        "",
        f"{inside} of {len(result['rows'])} step ratios within the goal; "
        f"{result['seconds']:.0f} s in all.",
    ]
    if result.get("note"):
        lines += ["", result["note"]]
    if result.get("repredicted"):
        lines += [
            "",
            "The analytic rows were re-predicted later (`--repredict`: traced on a CPU, priced by the "
            "CUDA preset of that code) beside the same measurements; the measured rows keep the predictions "
            "of the run.",
        ]
    return "\n".join(lines) + "\n"


def _write(
    out: Path,
    rows: list[dict[str, Any]],
    steps: int,
    started: float,
    device: str,
    call_ms: tuple[float, float],
) -> None:
    import torch

    result = {
        "rows": rows,
        "steps": steps,
        "goal_ratio": list(GOAL),
        "call_overhead_ms": list(call_ms),
        "environment": {
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "CPU",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "seconds": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "one_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "one_gpu.md").write_text(_markdown(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write (default: beside this script on cuda, a new temporary folder on cpu)",
    )
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the same rows"
    )
    p.add_argument(
        "--repredict",
        action="store_true",
        help="re-predict the analytic rows of --out's one_gpu.json; keep its measurements",
    )
    args = p.parse_args(argv)
    import torch

    if args.out is None:  # a CPU dry run never overwrites the GPU's results
        args.out = (
            Path(__file__).resolve().parent
            if args.device == "cuda" or args.repredict
            else Path(tempfile.mkdtemp(prefix="fxpipe-one-gpu-dry-"))
        )
        print(f"writing to {args.out}", flush=True)
    if args.repredict:
        saved = json.loads((args.out / "one_gpu.json").read_text())
        saved["rows"] = [_repredicted(r) if r["timing"] == "analytic" else r for r in saved["rows"]]
        saved["repredicted"] = True
        (args.out / "one_gpu.json").write_text(json.dumps(saved, indent=1) + "\n")
        (args.out / "one_gpu.md").write_text(_markdown(saved))
        return 0

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("needs a CUDA device")
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    from fxpipe.tracer.measure.timing import call_overhead_ms

    started = time.perf_counter()
    call_ms = call_overhead_ms(args.device)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxpipe-one-gpu-") as builds:
        for name in names:
            for timing in TIMINGS:
                for layout in LAYOUTS:
                    row = _row(name, timing, layout, args.steps, Path(builds), args.device)
                    rows.append(row)
                    _write(
                        args.out, rows, args.steps, started, args.device, call_ms
                    )  # after each row: a cut-off run keeps its rows
                    print(
                        f"{name:10s} {timing:8s} {layout[0]:18s} unit sum {row['unit_ms']:8.2f} ms  measured "
                        f"{row['measured_step_ms']:8.2f} ms  predicted {row['predicted_step_ms']:8.2f} ms  "
                        f"ratio {row['ratio']:.2f}  memory {', '.join(f'{x:.2f}' for x in row['memory_ratio'])}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
