"""The step simulator against pp x tp runs on this machine: S x T in {2x1, 1x2, 2x2}.

    PYTHONPATH=.:benchmarks/prediction .venv/bin/python benchmarks/prediction/tensor_parallel.py
        [--steps 16] [--configs 2x1,1x2,2x2] [--schedule 1f1b] [--runs 4] [--out benchmarks/prediction]

configurations.py's design for S x R, with a tp group of T ranks per stage in place of the
replicas (``fxpipe run --tp T``: S x T gloo processes, tp innermost). For each S x T a run
traces examples/gpt.py (unit times measured right before it), plans S stages
(``plan_partition``), writes the build (its ``tp_plan.json``: which linears split at degree T,
the plan the runtime applies) and trains ``--steps`` SGD steps with ``run_build(tp=T)``.
The prediction prices that build's split as one rank of a tp group runs it
(``fxpipe.partitioner.tensor_parallel.tensor_parallel_profile`` with the plan's styles at T,
the loopback link and the runtime's ``tp_pair_ms``) and simulates it (``predict``) for
S x T processes on this host's cores (Note [shared cores]). Measured: the median step (first
excluded) and each rank's peak tensor memory, against the predicted step and the predicted
peak of the rank's stage (every rank of a tp group holds its share of the stage).
Rows x1 are the control (no TP: configurations.py's row).

The design is fixed before a run: every row runs ``--runs`` times in rounds over the rows
and is the median of all its runs; the goal (0.80-1.33 for the step, 0.80-1.20 for memory) is
judged on the first full run after a change to the model. The compute and message probes
before and after each run are reported beside the rows, not used to choose runs.
Writes tensor_parallel.json and tensor_parallel.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from configurations import GOAL, MODELS, _levels, _probe_ms, median_row
from message_probe import MessageProbe

MEMORY_GOAL = (0.80, 1.20)


def styles_at(build: Path, degree: int) -> dict[str, str]:
    """The build's plan at ``degree``: every stage's split linears (module path -> style)."""
    from fxpipe.codegen.tp_plan import TensorParallelPlan

    if degree == 1:
        return {}
    plan = TensorParallelPlan.from_json(build / "tp_plan.json")
    styles: dict[str, str] = {}
    for stage in plan.stages:
        styles.update(stage.for_degree(degree).styles)
    return styles


def _measure(
    stages: int,
    degree: int,
    schedule: str,
    steps: int,
    builds: Path,
    messages: MessageProbe | None,
) -> dict[str, Any]:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import build_problem, plan_partition, predict
    from fxpipe.partitioner.cost import LINK_PRESETS
    from fxpipe.partitioner.prediction import runtime_costs_for, shared_cores
    from fxpipe.partitioner.tensor_parallel import tensor_parallel_profile
    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.train.run_options import RunOptions
    from fxpipe.tracer import trace_model_file

    model_file, batch, micro = MODELS["gpt"]
    source = load_model_file(model_file)
    probe = _probe_ms()
    message = messages.measure() if messages is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, batch // micro, progress=False, measure_times=True)
    plan = plan_partition(traced.profile, stages, schedule=schedule, microbatches=micro)
    build = builds / f"gpt-{stages}x{degree}-{schedule}"
    write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
    run = run_build(
        build,
        RunOptions(steps=steps, schedule=schedule, microbatches=micro, batch_size=batch, tp=degree),
        quiet=True,
    )
    styles = styles_at(build, degree)
    runtime = runtime_costs_for("cpu", traced.profile.host_slowdown)
    bandwidth, latency = LINK_PRESETS["loopback"]
    priced = tensor_parallel_profile(
        traced.profile,
        styles,
        degree,
        bandwidth,
        latency,
        pair_ms=(runtime.tp_pair_fwd_ms, runtime.tp_pair_bwd_ms),
    )
    problem = build_problem(
        priced,
        stages,
        schedule=schedule,
        microbatches=micro,
        cost=plan.cost,
        virtual_stages=plan.virtual_stages,
    )
    assignment = tuple(plan.stage_of(u.name) for u in traced.profile.units)
    cores = len(os.sched_getaffinity(0))
    prediction = predict(
        problem,
        assignment,
        traced.profile.batch_size,
        runtime=shared_cores(runtime, stages * degree, cores),
    )
    predicted = prediction.step_ms[schedule]
    memory = list(prediction.peak_memory_bytes_by_schedule[schedule])  # per stage
    tensors = list(run.peak_tensor_bytes)  # per rank, rank = stage x T + tp index
    row: dict[str, Any] = {
        "model": "gpt",
        "stages": stages,
        "tp": degree,
        "schedule": schedule,
        "microbatches": micro,
        "batch_size": batch,
        "split_linears": len(styles),
        "measured_step_ms": run.median_step_ms,
        "predicted_step_ms": predicted,
        "ratio": run.median_step_ms / predicted,
        "cores": cores,
        "predicted_rank_memory_bytes": memory,
        "measured_peak_tensor_bytes": tensors,
        "tensor_memory_ratio": [t / memory[i // degree] for i, t in enumerate(tensors)],
        "unit_ms": sum(u.fwd_ms + u.bwd_ms for u in traced.profile.units),
        "priced_unit_ms": sum(u.fwd_ms + u.bwd_ms for u in priced.units),
        "host_slowdown": traced.profile.host_slowdown,
        "probe_ms": [probe, _probe_ms()],
        "message_probe_ms": [message, messages.measure()] if messages is not None else None,
        "load_average_1min": os.getloadavg()[0],
    }
    return row


def _in_goal(row: dict[str, Any]) -> bool:
    return GOAL[0] <= row["ratio"] <= GOAL[1]


def _memory_in_goal(row: dict[str, Any]) -> bool:
    return all(MEMORY_GOAL[0] <= r <= MEMORY_GOAL[1] for r in row["tensor_memory_ratio"])


def _median_row(runs: list[dict[str, Any]], levels: Any) -> dict[str, Any]:
    scalars = (
        "measured_step_ms",
        "predicted_step_ms",
        "ratio",
        "unit_ms",
        "priced_unit_ms",
        "load_average_1min",
    )
    row = median_row(runs, levels, scalars, "ratio")
    row["within_goal"] = _in_goal(row)
    row["memory_within_goal"] = _memory_in_goal(row)
    return row


def _markdown(rows: list[dict[str, Any]], steps: int, runs: int) -> str:
    lines = [
        "# Simulator vs measured step: pp x tp",
        "",
        f"examples/gpt.py (batch 8, 4 microbatches of 2), 1f1b, {steps} SGD steps, median step "
        "excluding the first, gloo on CPU (S x T processes on this machine's 2 shared cores, tp "
        "innermost). The gpt example's attention computes q, k, v in one fused linear and splits it, "
        "so only its MLPs split (fc colwise, proj rowwise: the build's tp_plan.json). Predicted: the "
        "build's split priced as one rank of the tp group runs it (split work / T, two all-reduces "
        "per pair on the loopback link, the runtime's tp_pair_ms per pair) and simulated for S x T "
        "processes on this host's cores. Ratio = measured / predicted; goal 0.80-1.33 (step), "
        "0.80-1.20 (each rank's peak tensor memory / its stage's predicted peak). Each row is the "
        f"median of its {runs} runs, in rounds over the rows; 'quiet': the compute probe before "
        "and after within 15% of the benchmark's fastest and the message probe within 20% of its "
        "median (reported, not used to choose runs).",
        "",
        "| S x T | split linears | measured ms | predicted ms | ratio | range | in goal "
        "| tensor memory ratio per rank | memory in goal | unit ms (tp 1) | unit ms as one rank "
        "| quiet runs | quiet ratio | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = ", ".join(f"{x:.2f}" for x in r["tensor_memory_ratio"])
        lo, hi = r["ratio_range"]
        quiet = r["ratio_of_quiet_runs"]
        lines.append(
            f"| {r['stages']}x{r['tp']} | {r['split_linears']} | {r['measured_step_ms']:.2f} | "
            f"{r['predicted_step_ms']:.2f} | {r['ratio']:.2f} | {lo:.2f}-{hi:.2f} | "
            f"{'yes' if r['within_goal'] else 'NO'} | {mem} | "
            f"{'yes' if r['memory_within_goal'] else 'NO'} | {r['unit_ms']:.2f} | "
            f"{r['priced_unit_ms']:.2f} | {r['quiet_runs']} of {len(r['runs'])} | "
            f"{'n/a' if quiet is None else format(quiet, '.2f')} | {r['load_average_1min']:.1f} |"
        )
    probes = [t for r in rows for run in r["runs"] for t in run["probe_ms"]]
    lines += [
        "",
        f"{sum(_in_goal(r) for r in rows)} of {len(rows)} step ratios and "
        f"{sum(_memory_in_goal(r) for r in rows)} of {len(rows)} rows' memory within the goal.",
        "",
        f"The host: compute probe {min(probes):.2f} ms at its fastest, "
        f"{statistics.median(probes):.2f} in the median "
        f"({statistics.median(probes) / min(probes):.2f}x).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--configs", default="2x1,1x2,2x2")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    builds = Path(tempfile.mkdtemp(prefix="fxpipe-tp-"))
    started = time.perf_counter()
    attempts: list[list[dict[str, Any]]] = [[] for _ in configs]
    with MessageProbe() as messages:
        for round_ in range(args.runs):
            for i, (stages, degree) in enumerate(configs):
                run = _measure(stages, degree, args.schedule, args.steps, builds, messages)
                attempts[i].append(run)
                print(
                    f"round {round_ + 1} {stages}x{degree} measured {run['measured_step_ms']:8.2f} "
                    f"ms predicted {run['predicted_step_ms']:8.2f} ms ratio {run['ratio']:.2f} "
                    f"memory {', '.join(format(x, '.2f') for x in run['tensor_memory_ratio'])}",
                    flush=True,
                )
            levels = _levels(attempts)
            rows = [_median_row(tried, levels) for tried in attempts if tried]
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "tensor_parallel.json").write_text(
                json.dumps(
                    {
                        "rows": rows,
                        "steps": args.steps,
                        "runs": args.runs,
                        "goal_ratio": list(GOAL),
                        "memory_goal_ratio": list(MEMORY_GOAL),
                        "seconds": time.perf_counter() - started,
                    },
                    indent=1,
                )
                + "\n"
            )
            (args.out / "tensor_parallel.md").write_text(_markdown(rows, args.steps, args.runs))
    print((args.out / "tensor_parallel.md").read_text(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
