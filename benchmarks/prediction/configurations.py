"""The step simulator against the configurations this machine can run: S x R in {2x1, 4x1, 2x2}, each schedule.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/configurations.py [--steps 8] [--configs 2x1,4x1,2x2]
        [--schedules gpipe,1f1b,zb-h1,interleaved-1f1b,zbv] [--model gpt] [--out benchmarks/prediction]
        [--recompute] [--timing measured|analytic] [--runs 6]

For each S x R and schedule (with its least stages per rank) it traces examples/gpt.py, unit
times measured on this machine right before the row runs (``--timing analytic``: the analytic
estimate; this machine's speed drifts by 10-20% over minutes, so one trace for every row
mismatched the later rows), plans it with ``dp_replicas=R`` on the loopback link (``plan_partition``: the planner's own
prediction, the same simulator as ``fxpipe plan --devices``), writes the build, and
trains ``--steps`` SGD steps with ``run_build`` (S x R gloo processes on CPU, DDP over the
replicas). It records the median step (first excluded) against
``plan.prediction.step_ms[schedule]`` and each rank's peak tensor memory against the
prediction's (``plan.prediction.peak_memory_bytes_by_schedule``, Note [memory over time]).
``--recompute`` adds, for each schedule without a split backward, a row with every stage
recomputing, and the measured / predicted drop of each rank's peak against the plain row.
Every row is measured ``--runs`` times (trace, plan, run; 6 by default), in rounds over all
the rows, and is the median of all its runs, with their range: a fixed design (no rerun that
depends on what a run read) and an estimator that holds while fewer than half of a row's runs
are outliers either way. This machine's speed changes by up to 3x for seconds at a time, so
each run also records the host's state, reported beside the rows but not used to choose runs:
a fixed workload timed before the trace and after the run (the run is "quiet" when both are
within 15% of the fastest of the benchmark) and two gloo processes of ``message_probe.py``
timing a compute-and-message loop before and after it (quiet also needs both within 20% of
the benchmark's median probe). The table gives the quiet runs' count and median ratio.
Writes configurations.json and configurations.md; only measured rows.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from message_probe import MessageProbe, ProbeError

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"gpt": (ROOT / "examples" / "gpt.py", 8, 4), "mlp": (ROOT / "examples" / "mlp.py", 16, 4)}
GOAL = (0.80, 1.33)  # prediction within 25% of the measurement
QUIET = 1.15  # a run is quiet when its speed probes, before and after, are within this of the benchmark's fastest
MESSAGE_QUIET = 1.20  # ... and its message probes are within this of the benchmark's median probe
TIMING = "measured"
SAVING_FLOOR = (
    0.05  # a recompute row's saving is compared where at least this share of the peak is to go
)


def _probe_ms() -> float:
    """Median ms of a fixed one-thread workload (the tiny GPT's forward + backward at batch 2): the
    machine's speed right now. This VM's speed changes by up to 3x for seconds at a time."""
    import torch

    from fxpipe.modelfile import load_model_file

    gpt = load_model_file(MODELS["gpt"][0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = gpt.build_model(), gpt.example_inputs(2)[0]
    times = []
    for i in range(25):
        t = time.perf_counter()
        model(x).sum().backward()
        if i >= 5:
            times.append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return statistics.median(times) * 1e3


def _measure(
    model: str,
    stages: int,
    replicas: int,
    schedule: str,
    steps: int,
    builds: Path,
    recompute: bool = False,
    messages: MessageProbe | None = None,
) -> dict[str, Any]:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import CostModel, plan_partition
    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.train.run_options import RunOptions
    from fxpipe.tracer import trace_model_file

    model_file, batch, micro = MODELS[model]
    source = load_model_file(model_file)
    probe = _probe_ms()
    message = messages.measure() if messages is not None else None
    with warnings.catch_warnings():  # unit times measured now, right before this row runs
        warnings.simplefilter("ignore")
        traced = trace_model_file(
            source, batch // micro, progress=False, measure_times=TIMING == "measured"
        )
    virtual = 2 if schedule in ("interleaved-1f1b", "zbv") else 1
    plan = plan_partition(
        traced.profile,
        stages,
        schedule=schedule,
        microbatches=micro,
        cost=CostModel(
            dp_replicas=replicas, recompute=(True,) * (stages * virtual) if recompute else ()
        ),
    )
    build = builds / f"{model}-{stages}x{replicas}-{schedule}{'-recompute' if recompute else ''}"
    write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
    run = run_build(
        build,
        RunOptions(
            steps=steps, schedule=schedule, microbatches=micro, batch_size=batch, dp=replicas
        ),
        quiet=True,
    )
    assert plan.prediction is not None
    predicted = plan.prediction.step_ms[schedule]
    # the same split on this host's shared cores (Note [shared cores]): an explicit second prediction
    from fxpipe.partitioner import build_problem, predict
    from fxpipe.partitioner.prediction import runtime_costs_for, shared_cores

    problem = build_problem(
        traced.profile,
        stages,
        schedule=schedule,
        microbatches=micro,
        cost=plan.cost,
        virtual_stages=plan.virtual_stages,
    )
    assignment = tuple(plan.stage_of(u.name) for u in traced.profile.units)
    cores = len(os.sched_getaffinity(0))
    runtime = runtime_costs_for(
        "cpu", traced.profile.host_slowdown
    )  # at the trace's speed (Note [host speed])
    host = predict(
        problem,
        assignment,
        traced.profile.batch_size,
        runtime=shared_cores(runtime, stages * replicas, cores),
    ).step_ms[schedule]
    memory = list(plan.prediction.peak_memory_bytes_by_schedule[schedule])
    tensors = list(run.peak_tensor_bytes)
    row: dict[str, Any]
    row = {
        "model": model,
        "stages": stages,
        "replicas": replicas,
        "schedule": schedule,
        "recompute": recompute,
        "virtual_stages": plan.virtual_stages,
        "microbatches": micro,
        "batch_size": batch,
        "measured_step_ms": run.median_step_ms,
        "predicted_step_ms": predicted,
        "ratio": run.median_step_ms / predicted,
        "cores": cores,
        "predicted_on_shared_cores_ms": host,
        "ratio_on_shared_cores": run.median_step_ms / host,
        "predicted_rank_memory_bytes": memory,
        "measured_peak_tensor_bytes": tensors,
        "tensor_memory_ratio": [t / memory[i % len(memory)] for i, t in enumerate(tensors)]
        if memory
        else [],
        "unit_ms": sum(u.fwd_ms + u.bwd_ms for u in traced.profile.units),
        "host_slowdown": traced.profile.host_slowdown,  # the trace's, at which the fixed costs are priced
        "probe_ms": [probe, _probe_ms()],  # the machine's speed before the trace and after the run
        "message_probe_ms": [message, messages.measure()] if messages is not None else None,
        "load_average_1min": os.getloadavg()[0],
    }
    row["within_goal"] = _in_goal(row)
    return row


@dataclass(frozen=True)
class HostLevels:
    """This host at its usual: the fastest compute probe of the benchmark (a fixed workload's
    floor, steady on a quiet host) and the median message probe (the fastest message probe is
    one lucky pass, not a level)."""

    quiet_probe_ms: float
    typical_message_ms: float | None


def _quiet(run: dict[str, Any], levels: HostLevels) -> bool:
    """The machine ran at its quiet speed through the run: both compute probes within 15% of the
    benchmark's fastest, and both message probes at most 20% above the benchmark's median."""
    if max(run["probe_ms"]) > QUIET * levels.quiet_probe_ms:
        return False
    messages = run.get("message_probe_ms")
    typical = levels.typical_message_ms
    return typical is None or not messages or max(messages) <= MESSAGE_QUIET * typical


def _levels(attempts: list[list[dict[str, Any]]]) -> HostLevels:
    """The ``HostLevels`` of every run so far (at least one)."""
    runs = [run for tried in attempts for run in tried]
    messages = [t for run in runs for t in run.get("message_probe_ms") or ()]
    return HostLevels(
        min(t for run in runs for t in run["probe_ms"]),
        statistics.median(messages) if messages else None,
    )


def median_row(
    runs: list[dict[str, Any]],
    levels: HostLevels,
    scalars: tuple[str, ...],
    ratio_key: str,
) -> dict[str, Any]:
    """One row from all its runs: the medians of ``scalars`` and of the per-rank memory lists, the
    range of ``ratio_key``; beside them, how many runs were quiet and their median ratio. Shared
    by the prediction benchmarks, which add their own goals."""
    med = statistics.median
    row = dict(runs[0])
    for key in scalars:
        row[key] = med(r[key] for r in runs)
    for key in ("measured_peak_tensor_bytes", "predicted_rank_memory_bytes", "tensor_memory_ratio"):
        row[key] = [med(values) for values in zip(*(r[key] for r in runs))]
    ratios = [r[ratio_key] for r in runs]
    row["ratio_range"] = [min(ratios), max(ratios)]
    row["runs"] = runs
    quiet = [r[ratio_key] for r in runs if _quiet(r, levels)]
    row["quiet_runs"] = len(quiet)
    row["ratio_of_quiet_runs"] = med(quiet) if quiet else None
    return row


def _median_row(runs: list[dict[str, Any]], levels: HostLevels) -> dict[str, Any]:
    scalars = (
        "measured_step_ms",
        "predicted_step_ms",
        "predicted_on_shared_cores_ms",
        "ratio",
        "ratio_on_shared_cores",
        "unit_ms",
        "load_average_1min",
    )
    row = median_row(runs, levels, scalars, "ratio_on_shared_cores")
    row["within_goal"] = _in_goal(row)
    row["message_probe_ms"] = (
        statistics.median(max(r["message_probe_ms"]) for r in runs)
        if all(r.get("message_probe_ms") for r in runs)
        else None
    )
    return row


def _label(config: str, schedule: str, recompute: bool) -> str:
    return f"{config} {schedule:16s}{' recompute' if recompute else ''}"


def _in_goal(row: dict[str, Any]) -> bool:
    """Measured / predicted for this host (its shared cores) within the goal."""
    return GOAL[0] <= row["ratio_on_shared_cores"] <= GOAL[1]


def _saving(plain: dict[str, Any], recompute: dict[str, Any]) -> list[float | None]:
    """Per rank, the median over rounds of the measured / predicted drop of the peak from the plain
    row's run to the recompute row's run of the same round: the two runs' splits are planned from
    their own traces, so a drop is only compared within a round. ``None``: under
    ``SAVING_FLOOR`` of the plain peak predicted to drop, which a few KiB of noise would swamp."""
    per_rank: list[list[float]] = [[] for _ in recompute["measured_peak_tensor_bytes"]]
    for base, run in zip(plain.get("runs", [plain]), recompute.get("runs", [recompute])):
        replicas = run["replicas"]
        pairs = zip(
            base["measured_peak_tensor_bytes"],
            run["measured_peak_tensor_bytes"],
            base["predicted_rank_memory_bytes"] * replicas,
            run["predicted_rank_memory_bytes"] * replicas,
        )
        for rank, (mb, mr, pb, pr) in enumerate(pairs):
            if pb - pr >= SAVING_FLOOR * pb:
                per_rank[rank].append((mb - mr) / (pb - pr))
    return [statistics.median(v) if v else None for v in per_rank]


def _markdown(rows: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "# Simulator vs measured step: S x R configurations",
        "",
        f"examples/gpt.py, {steps} SGD steps, median step excluding the first, gloo on CPU (S x R processes "
        "on this machine's 2 shared cores). Ratio = measured / predicted; goal 0.80-1.33. Memory: peak live "
        "tensor bytes per rank / the predicted rank peak (replicas repeat the ranks of their pipeline); "
        "recompute rows: every stage recomputes, and 'saving' is the measured / predicted drop of each "
        "rank's peak against the plain row's run of the same round (each run plans its own split), the "
        "median over the rounds ('-': a drop under 5% of the plain peak predicted). 'This host': the "
        "prediction for S x R processes on this host's cores (Note [shared cores] and Note [processor sharing]: the running actions share the "
        "cores), the one the goal is checked against (the same as one core per rank for 2 processes); "
        "'one core per rank': the prediction for a cluster of S x R devices. Unit times measured on "
        "this machine right before each run; each row is the median of all its runs (the ratio's range "
        "across them beside it; 'unit ms': the profile's forward + backward per microbatch, which shows "
        "the machine's drift; 'quiet': runs before and after which a fixed workload's time was at most "
        "15% above the benchmark's fastest, and whose message probes, before and after, were at most 20% "
        "above the median of the benchmark ('message ms', message_probe.py: two gloo processes computing "
        "and exchanging 8 KiB, ms per iteration), with their median ratio; reported, not used to choose "
        "runs). Load: mostly the benchmark's own 2-4 processes.",
        "",
        "| S x R | schedule | V | recompute | measured ms | this host: predicted ms | ratio | range | in goal "
        "| one core per rank: predicted ms | ratio | tensor memory ratio per rank | saving measured / predicted "
        "| unit ms | message ms | quiet runs | quiet ratio | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = {(r["stages"], r["replicas"], r["schedule"]): r for r in rows if not r.get("recompute")}
    for r in rows:
        mem = ", ".join(f"{x:.2f}" for x in r["tensor_memory_ratio"])
        lo, hi = r.get("ratio_range", [r["ratio_on_shared_cores"]] * 2)
        base = (
            plain.get((r["stages"], r["replicas"], r["schedule"])) if r.get("recompute") else None
        )
        saving = (
            ", ".join("-" if x is None else f"{x:.2f}" for x in _saving(base, r))
            if base is not None
            else ""
        )
        lines.append(
            f"| {r['stages']}x{r['replicas']} | {r['schedule']} | {r['virtual_stages']} | "
            f"{'yes' if r.get('recompute') else 'no'} | "
            f"{r['measured_step_ms']:.2f} | {r['predicted_on_shared_cores_ms']:.2f} | "
            f"{r['ratio_on_shared_cores']:.2f} | {lo:.2f}-{hi:.2f} | {'yes' if _in_goal(r) else 'NO'} | "
            f"{r['predicted_step_ms']:.2f} | {r['ratio']:.2f} | {mem} | {saving} | "
            f"{r['unit_ms']:.2f} | "
            f"{'n/a' if r.get('message_probe_ms') is None else format(r['message_probe_ms'], '.2f')} | "
            f"{r['quiet_runs']} of {len(r['runs'])} | "
            f"{'n/a' if r['ratio_of_quiet_runs'] is None else format(r['ratio_of_quiet_runs'], '.2f')} | "
            f"{r['load_average_1min']:.1f} |"
        )
    inside = sum(_in_goal(r) for r in rows)
    quiet = [r["ratio_of_quiet_runs"] for r in rows if r["ratio_of_quiet_runs"] is not None]
    quiet_inside = sum(GOAL[0] <= q <= GOAL[1] for q in quiet)
    probes = [t for r in rows for run in r["runs"] for t in run["probe_ms"]]
    slow = statistics.median(probes) / min(probes)
    gauged = [run["host_slowdown"] for r in rows for run in r["runs"] if "host_slowdown" in run]
    host = (
        f"The host: compute probe {min(probes):.2f} ms at its fastest, {statistics.median(probes):.2f} in the "
        f"median ({slow:.2f}x); {sum(r['quiet_runs'] for r in rows)} of {sum(len(r['runs']) for r in rows)} runs "
        "quiet. "
        + (
            "A quiet host (median within 15% of the fastest)."
            if slow <= QUIET
            else "Not a quiet host (median over 15% above the fastest)."
        )
        + (
            f" The traces' host slowdown, at which the runtime's fixed costs are priced (Note [host speed]): "
            f"{statistics.median(gauged):.2f} in the median, {min(gauged):.2f}-{max(gauged):.2f}."
            if gauged
            else ""
        )
    )
    return "\n".join(
        lines
        + [
            "",
            f"{inside} of {len(rows)} step ratios within the goal (by the median of all "
            f"of a row's runs; {quiet_inside} of the {len(quiet)} rows with a quiet run by "
            "the median of their quiet runs).",
            "",
            host,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--configs", default="2x1,4x1,2x2")
    p.add_argument("--schedules", default="gpipe,1f1b,zb-h1,interleaved-1f1b,zbv")
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument(
        "--recompute",
        action="store_true",
        help="also run every schedule without a split backward with every stage recomputing",
    )
    p.add_argument(
        "--runs", type=int, default=6, help="trace, plan and run each row this many times"
    )
    p.add_argument(
        "--timing",
        choices=("measured", "analytic"),
        default="measured",
        help="unit times: measured on this machine before the runs (default), or the analytic estimate",
    )
    args = p.parse_args(argv)
    global TIMING
    TIMING = args.timing
    with MessageProbe() as messages:
        return _run(args, messages)


def _run(args: argparse.Namespace, messages: MessageProbe) -> int:
    builds = Path(tempfile.mkdtemp(prefix="fxpipe-configs-"))
    started = time.perf_counter()
    rows_to_run: list[tuple[str, int, int, str, bool]] = []
    for config in args.configs.split(","):
        stages, replicas = (int(x) for x in config.split("x"))
        runs = [(s, False) for s in args.schedules.split(",")]
        if args.recompute:
            runs += [(s, True) for s in args.schedules.split(",") if s not in ("zb-h1", "zbv")]
        rows_to_run += [
            (config, stages, replicas, schedule, recompute) for schedule, recompute in runs
        ]
    # Rounds over all rows, not a row's runs back to back: a slow minute of this machine then
    # falls on one run of several rows, which their medians leave out, not on every run of one.
    attempts: list[list[dict[str, Any]]] = [[] for _ in rows_to_run]
    refused: set[int] = set()
    rows: list[dict[str, Any]] = []
    for round_ in range(args.runs):
        for i, (config, stages, replicas, schedule, recompute) in enumerate(rows_to_run):
            if i in refused:
                continue
            label = _label(config, schedule, recompute)
            try:
                attempts[i].append(
                    _measure(
                        args.model,
                        stages,
                        replicas,
                        schedule,
                        args.steps,
                        builds,
                        recompute,
                        messages,
                    )
                )
            except ProbeError:
                raise  # the probe, not this configuration
            except Exception as exc:  # a configuration the runtime refuses (e.g. sharding x split backward): say so
                print(f"{label}: not run: {exc}", file=sys.stderr, flush=True)
                refused.add(i)
                continue
            run = attempts[i][-1]
            print(
                f"round {round_ + 1} {label} measured {run['measured_step_ms']:8.2f} ms predicted "
                f"{run['predicted_on_shared_cores_ms']:8.2f} ms (this host) ratio {run['ratio_on_shared_cores']:.2f}"
                f" messages {max(run['message_probe_ms']):.2f} ms"
                f"{' (quiet)' if _quiet(run, _levels(attempts)) else ''}",
                flush=True,
            )
        if not any(attempts):
            break
        levels = _levels(attempts)
        rows = [
            _median_row(tried, levels)
            for i, tried in enumerate(attempts)
            if tried and i not in refused
        ]
        args.out.mkdir(
            parents=True, exist_ok=True
        )  # after every round: a cut-off run keeps what it measured
        (args.out / "configurations.json").write_text(
            json.dumps(
                {
                    "rows": rows,
                    "steps": args.steps,
                    "runs": args.runs,
                    "goal_ratio": list(GOAL),
                    "seconds": time.perf_counter() - started,
                },
                indent=1,
            )
            + "\n"
        )
        (args.out / "configurations.md").write_text(_markdown(rows, args.steps))
    for row in rows:
        label = _label(f"{row['stages']}x{row['replicas']}", row["schedule"], row["recompute"])
        print(
            f"{label} measured {row['measured_step_ms']:8.2f} ms predicted {row['predicted_on_shared_cores_ms']:8.2f} "
            f"ms (this host) ratio {row['ratio_on_shared_cores']:.2f} ({row['ratio_range'][0]:.2f}-"
            f"{row['ratio_range'][1]:.2f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
