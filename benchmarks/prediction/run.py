"""Prediction benchmark: the planner's predicted step time and memory vs a real run.

    .venv/bin/python benchmarks/prediction/run.py [--steps 10] [--models gpt,mlp] [--out benchmarks/prediction]
    .venv/bin/python benchmarks/prediction/run.py --repredict   # new predictions, same measurements

For each model x timing mode (analytic roofline, ``measure_times``) it traces at the
microbatch size, plans 2 stages and writes a build directory; then for each schedule
(gpipe, 1f1b) it trains ``--steps`` SGD steps with ``fxpipe.runtime.launch.launcher.run_build``
(2 torchrun ranks, gloo, CPU) and records the measured median step (first step
excluded) against ``plan.prediction.step_ms[schedule]``, and each rank's peak
tensor memory (and peak resident memory) against the plan's per-stage memory. ``--repredict`` re-traces and
re-predicts for the SAME stage assignment (read from the saved build's plan) and keeps
the measured figures, to iterate on the cost model without re-running the jobs.
Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fxpipe.partitioner import Prediction

ROOT = Path(__file__).resolve().parents[2]
MODELS: dict[str, tuple[Path, int, int]] = {  # name: (model file, batch size, microbatches)
    "gpt": (ROOT / "examples" / "gpt.py", 8, 4),  # what `make demo` runs
    "mlp": (ROOT / "examples" / "mlp.py", 16, 4),
    "resnet": (ROOT / "examples" / "resnet.py", 16, 4),
    "branchy": (ROOT / "examples" / "branchy.py", 16, 4),
    "gpt_medium": (ROOT / "benchmarks" / "runtime" / "gpt_medium.py", 16, 4),
}
TIMINGS = ("analytic", "measured")
SCHEDULES = ("gpipe", "1f1b")
STAGES = 2
GOAL = (0.80, 1.33)  # prediction within 25% of the measurement: 0.75 m <= p <= 1.25 m


def _trace(model_file: Path, batch: int, microbatches: int, timing: str) -> Any:
    from fxpipe.modelfile import load_model_file
    from fxpipe.tracer import trace_model_file

    source = load_model_file(model_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GPTs' attention is kept as a leaf, with a warning
        traced = trace_model_file(
            source, batch // microbatches, measure_times=timing == "measured", progress=False
        )
    return source, traced


def _build(model_file: Path, out: Path, batch: int, microbatches: int, timing: str) -> Prediction:
    from fxpipe.codegen import write_build_dir
    from fxpipe.partitioner import plan_partition

    source, traced = _trace(model_file, batch, microbatches, timing)
    plan = plan_partition(traced.profile, STAGES, microbatches=microbatches)
    write_build_dir(traced, plan, out, source, batch_size=batch, microbatches=microbatches)
    assert plan.prediction is not None
    return plan.prediction


def _repredict(
    model_file: Path, build: Path, batch: int, microbatches: int, timing: str
) -> Prediction:
    """A new prediction for the assignment of ``build``'s plan (same split as the measurement)."""
    from fxpipe.partitioner import PartitionPlan, build_problem
    from fxpipe.partitioner.prediction import predict, runtime_costs_for

    _, traced = _trace(model_file, batch, microbatches, timing)
    plan = PartitionPlan.from_json(build / "plan.json")
    profile = traced.profile
    problem = build_problem(profile, STAGES, schedule=plan.schedule, microbatches=microbatches)
    assignment = tuple(plan.stage_of(u.name) for u in profile.units)
    runtime = runtime_costs_for(profile.trace_device, profile.host_slowdown)  # Note [host speed]
    return predict(problem, assignment, profile.batch_size, runtime=runtime)


def _baseline_rss() -> int:
    """Peak RSS of a process that imports torch and fxpipe's runtime and joins a 1-rank gloo group."""
    code = (
        "import os, resource, torch, torch.distributed as dist, fxpipe.runtime, fxpipe.codegen\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    )
    from fxpipe.runtime.launch.launcher import free_port

    env = {**os.environ, "PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


def _row(
    name: str,
    timing: str,
    schedule: str,
    pred: Prediction,
    run: dict[str, Any],
    base_rss: int,
    load: float,
) -> dict[str, Any]:
    predicted = pred.step_ms[schedule]
    measured = run["median_step_ms"]
    mem_pred = list(pred.peak_memory_bytes_by_schedule[schedule])
    mem_meas = run.get("peak_memory_bytes") or []
    tensors = (
        run.get("peak_tensor_bytes") or []
    )  # absent in runs made before the worker measured it
    return {
        "model": name,
        "timing": timing,
        "schedule": schedule,
        "measured_step_ms": measured,
        "predicted_step_ms": predicted,
        "ratio": measured / predicted,
        "within_goal": GOAL[0] <= measured / predicted <= GOAL[1],
        "predicted_pipeline_ms": pred.pipeline_ms[schedule],
        "predicted_step_overhead_ms": {
            **asdict(pred.step_overhead_ms),
            "total_ms": pred.step_overhead_ms.total_ms,
        },
        "step_seconds": run.get("step_seconds"),
        "run_medians_ms": run.get("run_medians_ms"),
        "load_average_1min": load,
        "predicted_stage_memory_bytes": mem_pred,
        "measured_peak_rss_bytes": mem_meas,
        "measured_rss_above_runtime_bytes": [m - base_rss for m in mem_meas],
        "measured_peak_tensor_bytes": tensors,
        "tensor_memory_ratio": [m / p if p else None for m, p in zip(tensors, mem_pred)]
        if tensors
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="torchrun jobs per configuration; the measurement is the median of their medians",
    )
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument(
        "--builds",
        type=Path,
        default=None,
        help="keep build directories here (default: a temp dir)",
    )
    p.add_argument(
        "--repredict",
        action="store_true",
        help="re-predict for the saved builds' splits; keep results.json's measurements",
    )
    args = p.parse_args(argv)
    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.train.run_options import RunOptions

    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    builds = args.builds or Path(tempfile.mkdtemp(prefix="fxpipe-prediction-"))
    old = json.loads((args.out / "results.json").read_text()) if args.repredict else None
    measured = {(r["model"], r["timing"], r["schedule"]): r for r in (old or {}).get("rows", [])}
    base_rss = old["runtime_rss_bytes"] if old else _baseline_rss()
    rows = []
    started = time.perf_counter()
    for name in names:
        model_file, batch, microbatches = MODELS[name]
        for timing in TIMINGS:
            build = builds / f"{name}-{timing}"
            if args.repredict:
                pred = _repredict(model_file, build, batch, microbatches, timing)
            else:
                pred = _build(model_file, build, batch, microbatches, timing)
            for schedule in SCHEDULES:
                if args.repredict:
                    r = measured[(name, timing, schedule)]
                    run = {
                        "median_step_ms": r["measured_step_ms"],
                        "peak_memory_bytes": r["measured_peak_rss_bytes"],
                        "peak_tensor_bytes": r.get("measured_peak_tensor_bytes"),
                        "step_seconds": r["step_seconds"],
                    }
                    load = r.get("load_average_1min", float("nan"))
                else:
                    options = RunOptions(
                        steps=args.steps,
                        schedule=schedule,
                        microbatches=microbatches,
                        batch_size=batch,
                    )
                    runs = [run_build(build, options, quiet=True) for _ in range(args.repeats)]
                    medians = sorted(r.median_step_ms for r in runs)
                    run = {
                        **runs[0].to_dict(),
                        "median_step_ms": statistics.median(medians),
                        "run_medians_ms": medians,
                    }
                    load = os.getloadavg()[0]
                row = _row(name, timing, schedule, pred, run, base_rss, load)
                rows.append(row)
                print(
                    f"{name:11s} {timing:8s} {schedule:5s} measured {row['measured_step_ms']:8.2f} ms  "
                    f"predicted {row['predicted_step_ms']:8.2f} ms  ratio {row['ratio']:.2f}",
                    flush=True,
                )
    result = {
        "rows": rows,
        "goal_ratio": list(GOAL),
        "steps": args.steps,
        "repeats": args.repeats,
        "stages": STAGES,
        "models": {
            n: {
                "file": str(MODELS[n][0].relative_to(ROOT)),
                "batch_size": MODELS[n][1],
                "microbatches": MODELS[n][2],
            }
            for n in names
        },
        "runtime_rss_bytes": base_rss,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "platform": platform.platform(),
        },
        "seconds": time.perf_counter() - started,
        "repredicted": bool(args.repredict),
        "builds": str(builds),
        "benchmark_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(_markdown(result))
    return 0


def _range(row: dict[str, Any]) -> str:
    runs = row.get("run_medians_ms") or []
    return f"{min(runs):.2f}-{max(runs):.2f}" if runs else "n/a"


def _markdown(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        "# Prediction benchmark results",
        "",
        f"2 stages on 2 torchrun ranks (gloo, CPU, one thread each), SGD, {result['steps']} steps, median "
        f"step excluding the first, median over {result.get('repeats', 1)} jobs (their range shows the "
        "machine's noise). Ratio = measured / predicted; goal (prediction within 25% of the measurement) "
        f"{result['goal_ratio'][0]}-{result['goal_ratio'][1]}. See README.md for the method.",
        "",
        "| model | batch = M x mb | timing | schedule | measured ms | range of jobs ms | predicted ms | ratio "
        "| in goal | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        m = result["models"][r["model"]]
        lines.append(
            f"| {r['model']} | {m['batch_size']} = {m['microbatches']} x "
            f"{m['batch_size'] // m['microbatches']} | {r['timing']} | {r['schedule']} | "
            f"{r['measured_step_ms']:.2f} | {_range(r)} | {r['predicted_step_ms']:.2f} | {r['ratio']:.2f} | "
            f"{'yes' if r['within_goal'] else 'NO'} | {r.get('load_average_1min', float('nan')):.1f} |"
        )
    inside = sum(r["within_goal"] for r in result["rows"])
    lines += [
        "",
        f"{inside} of {len(result['rows'])} ratios within the goal.",
        "",
        "Peak memory per rank (MiB). Predicted = the plan's stage memory (params, grads, optimizer state, "
        "activations, boundary buffers); measured tensors = peak bytes of live tensor storages over one "
        "extra step after the timed ones (fxpipe.runtime.pipeline.peak_memory), and ratio = measured / predicted; "
        "RSS = peak resident set size, and that minus the RSS of a process that only loads torch + the "
        f"runtime and joins gloo ({result['runtime_rss_bytes'] / mib:.0f} MiB), far above the model's "
        "tensors on CPU.",
        "",
        "| model | timing | schedule | predicted rank 0, 1 | measured tensors rank 0, 1 | ratio rank 0, 1 "
        "| measured RSS rank 0, 1 | RSS above runtime rank 0, 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pred = ", ".join(f"{b / mib:.2f}" for b in r["predicted_stage_memory_bytes"])
        tensors = (
            ", ".join(f"{b / mib:.2f}" for b in r.get("measured_peak_tensor_bytes") or []) or "n/a"
        )
        ratio = (
            ", ".join(
                "n/a" if x is None else f"{x:.2f}" for x in r.get("tensor_memory_ratio") or []
            )
            or "n/a"
        )
        meas = ", ".join(f"{b / mib:.0f}" for b in r["measured_peak_rss_bytes"])
        above = ", ".join(f"{b / mib:.0f}" for b in r["measured_rss_above_runtime_bytes"])
        lines.append(
            f"| {r['model']} | {r['timing']} | {r['schedule']} | {pred} | {tensors} | {ratio} | {meas} "
            f"| {above} |"
        )
    env = result["environment"]
    lines += [
        "",
        f"torch {env['torch']}, {env['cpus']} CPUs, load average at the end "
        f"{', '.join(f'{x:.2f}' for x in env['load_average'])}; "
        f"{'re-predicted on saved measurements' if result['repredicted'] else 'measured and predicted together'}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
